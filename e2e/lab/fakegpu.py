"""The lab's fake GPU: a small controller that decides how each training pod ends.

It watches pods labelled `finetune.dev/job` that kwok has made Running on a fake node, looks
up the rule (pod annotations, then the owning FineTuneJob's annotations, then the namespace's
`finetune-lab` ConfigMap), decides with fate.decide(), and writes the verdict as annotations
on the pod. kwok's `lab-pod-terminate` stage then performs the status change. The decision
is pure (fate.py); this module only reads the world and writes the verdict.

Run: python -m e2e.lab.fakegpu --kubeconfig PATH
"""

from __future__ import annotations

import argparse
import logging
import sys
import time

from kubernetes import client, config, watch
from kubernetes.client.rest import ApiException

from . import fate
from .nodes import RUNNER_KUBELET, RUNNER_LABEL

log = logging.getLogger("fake-gpu")

FTJ_GROUP, FTJ_VERSION, FTJ_PLURAL = "finetune.dev", "v1alpha1", "finetunejobs"


class FakeGPU:
    def __init__(self, api: client.ApiClient):
        self.core = client.CoreV1Api(api)
        self.custom = client.CustomObjectsApi(api)
        self._node_labels: dict[str, dict[str, str]] = {}

    def node_labels(self, name: str) -> dict[str, str]:
        if name not in self._node_labels:
            self._node_labels[name] = self.core.read_node(name).metadata.labels or {}
        return self._node_labels[name]

    def rule_sources(self, pod) -> list[fate.RuleSource]:
        ns, meta = pod.metadata.namespace, pod.metadata
        sources = [fate.RuleSource(f"pod {ns}/{meta.name}", fate.rule_values_from_annotations(meta.annotations))]
        # The job label is shortened for long names; the annotation has the full name.
        job = (meta.annotations or {}).get("finetune.dev/job-name") or (meta.labels or {}).get(fate.JOB_LABEL)
        if job:
            try:
                ftj = self.custom.get_namespaced_custom_object(FTJ_GROUP, FTJ_VERSION, ns, FTJ_PLURAL, job)
                annotations = ftj.get("metadata", {}).get("annotations")
                sources.append(fate.RuleSource(f"FineTuneJob {ns}/{job}", fate.rule_values_from_annotations(annotations)))
            except ApiException as exc:
                if exc.status != 404:  # no such job, or the CRD is not installed: no rules there
                    raise
        try:
            cm = self.core.read_namespaced_config_map(fate.RULES_CONFIGMAP, ns)
            sources.append(fate.RuleSource(f"ConfigMap {ns}/{fate.RULES_CONFIGMAP}", dict(cm.data or {})))
        except ApiException as exc:
            if exc.status != 404:
                raise
        return sources

    def verdict_for(self, pod) -> fate.Verdict:
        meta = pod.metadata
        try:
            rule = fate.resolve_rule(self.rule_sources(pod))
            labels = self.node_labels(pod.spec.node_name)
            training = fate.TrainingPod(
                name=f"{meta.namespace}/{meta.name}",
                predicted_peak_bytes=fate.parse_predicted_peak((meta.annotations or {}).get(fate.PREDICTED_PEAK_ANNOTATION)),
                gpu_memory_mib=fate.parse_gpu_memory_mib(labels.get(fate.GPU_MEMORY_LABEL), pod.spec.node_name),
                rank=fate.rank_of(meta.labels),
                attempt=fate.attempt_of(meta.labels),
            )
        except fate.RuleError as exc:
            return fate.lab_failure(str(exc))
        return fate.decide(training, rule)

    @staticmethod
    def needs_verdict(pod) -> bool:
        meta = pod.metadata
        return (
            meta.deletion_timestamp is None
            and pod.spec.node_name is not None
            and pod.status is not None
            and pod.status.phase == "Running"
            and fate.VERDICT_EXIT_CODE not in (meta.annotations or {})
        )

    def handle(self, pod) -> None:
        if not self.needs_verdict(pod):
            return
        if self.node_labels(pod.spec.node_name).get(RUNNER_LABEL) == RUNNER_KUBELET:
            return  # a real kubelet runs this pod; it ends by itself
        verdict = self.verdict_for(pod)
        meta = pod.metadata
        body = {"metadata": {"annotations": verdict.annotations(), "resourceVersion": meta.resource_version}}
        try:
            self.core.patch_namespaced_pod(meta.name, meta.namespace, body)
        except ApiException as exc:
            if exc.status in (404, 409):  # gone, or changed since we read it: the watch brings it again
                return
            raise
        log.info("pod %s/%s: %s", meta.namespace, meta.name, verdict.summary)

    def run(self) -> None:
        selector = fate.JOB_LABEL
        while True:
            try:
                pods = self.core.list_pod_for_all_namespaces(label_selector=selector)
                for pod in pods.items:
                    self.handle(pod)
                w = watch.Watch()
                for event in w.stream(
                    self.core.list_pod_for_all_namespaces,
                    label_selector=selector,
                    resource_version=pods.metadata.resource_version,
                    timeout_seconds=120,
                ):
                    if event["type"] in ("ADDED", "MODIFIED"):
                        self.handle(event["object"])
            except ApiException as exc:
                if exc.status != 410:  # 410: watch too old, relist at once
                    log.warning("API error, relisting in 1s: %s", exc.reason)
                    time.sleep(1)
            except Exception as exc:  # keep the lab's GPU alive across transient errors, but say so
                log.warning("error, relisting in 1s: %r", exc)
                time.sleep(1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m e2e.lab.fakegpu", description=__doc__.splitlines()[0])
    parser.add_argument("--kubeconfig", required=True)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s", stream=sys.stderr)
    api = config.new_client_from_config(config_file=args.kubeconfig)
    log.info("fake GPU watching pods labelled %s", fate.JOB_LABEL)
    FakeGPU(api).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The lab GPU on the real kubelet nodes: a mutating admission webhook for the pods that land there.

On kwok's nodes the fake GPU decides how a pod ends (fakegpu.py). On the real nodes the kubelet runs
the pod as the operator rendered it, so the lab gives the trainer the lab GPU's variables here, when
the pod is created: the lab GPU's memory, and the peak this pod's plan truly reaches there under the
FineTuneJob's lab rule (fate.lab_gpu_environment, the rule the fake GPU applies too). The trainer
raises the lab GPU's out-of-memory itself (images/trainer/finetune_trainer/faults.py).

The rule's `host-memory-scale` (this machine is far smaller than the nodes the lab plays) scales the
pod's memory request and limit here, so that the kernel's OOM killer and the kubelet's `OOMKilled`
are real; the pod says so in the annotation SCALED_ANNOTATION.

Only pods that ask for a GPU and tolerate the real node's runner taint reach this webhook (the
configuration's matchConditions); it changes nothing else. A pod whose rule is malformed is refused
with the rule's message (the training operator's events show it), never started with a guess.

Run: python -m e2e.lab.gpuwebhook --kubeconfig PATH --port N --cert CRT --key KEY
"""

from __future__ import annotations

import argparse
import base64
import json
import logging
import math
import ssl
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from kubernetes import client, config

from . import fate
from .fakegpu import FakeGPU
from .nodes import GPU_RESOURCE, RUNNER_KUBELET, RUNNER_LABEL, load_pools

log = logging.getLogger("lab-gpu-webhook")

CONFIGURATION = "lab-gpu.finetune.dev"
PATH = "/mutate-pod"
SCALED_ANNOTATION = "lab.finetune.dev/host-memory-scaled"


def webhook_configuration(port: int, ca_pem: bytes) -> dict[str, Any]:
    """The MutatingWebhookConfiguration: pod creates that ask for a GPU on the real node, to 127.0.0.1."""
    wants_gpu = (f"object.spec.containers.exists(c, has(c.resources) && has(c.resources.limits)"
                 f" && '{GPU_RESOURCE}' in c.resources.limits)")
    on_real_node = (f"has(object.spec.tolerations) && object.spec.tolerations.exists(t, has(t.key)"
                    f" && t.key == '{RUNNER_LABEL}' && (!has(t.value) || t.value == '{RUNNER_KUBELET}'))")
    return {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "MutatingWebhookConfiguration",
        "metadata": {"name": CONFIGURATION},
        "webhooks": [{
            "name": CONFIGURATION,
            "clientConfig": {"url": f"https://127.0.0.1:{port}{PATH}", "caBundle": base64.b64encode(ca_pem).decode()},
            "rules": [{"operations": ["CREATE"], "apiGroups": [""], "apiVersions": ["v1"], "resources": ["pods"]}],
            "matchConditions": [{"name": "wants-a-gpu", "expression": wants_gpu},
                                {"name": "on-the-real-node", "expression": on_real_node}],
            "admissionReviewVersions": ["v1"],
            "sideEffects": "None",
            "failurePolicy": "Fail",
            "timeoutSeconds": 10,
            "reinvocationPolicy": "Never",
        }],
    }


def _quantity_bytes(value: str) -> int:
    from kubernetes.utils import parse_quantity

    return int(parse_quantity(value))


def pod_patch(pod: dict[str, Any], namespace: str, rule: fate.Rule, gpu_memory_mib: int) -> list[dict[str, Any]]:
    """The JSON patch for one pod: the lab GPU's variables into every container that asks for a GPU,
    and the rule's host-memory scale on every memory request and limit. Raises fate.RuleError."""
    meta = pod.get("metadata") or {}
    annotations = meta.get("annotations") or {}
    name = meta.get("name") or meta.get("generateName") or "?"
    training = fate.TrainingPod(
        name=f"{namespace}/{name}",
        predicted_peak_bytes=fate.parse_predicted_peak(annotations.get(fate.PREDICTED_PEAK_ANNOTATION)),
        gpu_memory_mib=gpu_memory_mib, rank=fate.rank_of(meta.get("labels")), attempt=fate.attempt_of(meta.get("labels")))
    env = fate.lab_gpu_environment(training, rule)
    ops: list[dict[str, Any]] = []
    scaled: list[str] = []
    for i, c in enumerate(pod["spec"]["containers"]):
        limits = (c.get("resources") or {}).get("limits") or {}
        if GPU_RESOURCE in limits:
            items = [{"name": k, "value": v} for k, v in sorted(env.items())]
            if c.get("env"):
                ops += [{"op": "add", "path": f"/spec/containers/{i}/env/-", "value": item} for item in items]
            else:
                ops.append({"op": "add", "path": f"/spec/containers/{i}/env", "value": items})
        if rule.host_memory_scale < 1:
            for kind in ("requests", "limits"):
                value = ((c.get("resources") or {}).get(kind) or {}).get("memory")
                if value is None:
                    continue
                new = f"{max(1, math.floor(_quantity_bytes(value) * rule.host_memory_scale / fate.MIB))}Mi"
                ops.append({"op": "replace", "path": f"/spec/containers/{i}/resources/{kind}/memory", "value": new})
                if kind == "limits":
                    scaled.append(f"{c['name']} {value} -> {new}")
    if scaled:
        key = SCALED_ANNOTATION.replace("~", "~0").replace("/", "~1")
        if "annotations" not in meta:
            ops.append({"op": "add", "path": "/metadata/annotations", "value": {}})
        ops.append({"op": "add", "path": f"/metadata/annotations/{key}",
                    "value": f"x{rule.host_memory_scale} (lab rule host-memory-scale): " + ", ".join(scaled)})
    return ops


class Webhook:
    def __init__(self, api: client.ApiClient, gpu_memory_mib: int) -> None:
        self.gpu = FakeGPU(api)  # its rule sources: the pod, its FineTuneJob, the namespace's ConfigMap
        self.gpu_memory_mib = gpu_memory_mib

    def review(self, body: dict[str, Any]) -> dict[str, Any]:
        request = body["request"]
        pod = request["object"]
        namespace = request.get("namespace") or (pod.get("metadata") or {}).get("namespace") or "default"
        meta = pod.get("metadata") or {}
        response: dict[str, Any] = {"uid": request["uid"], "allowed": True}
        try:
            rule = fate.resolve_rule(self.gpu.rule_sources(client.V1Pod(metadata=client.V1ObjectMeta(
                name=meta.get("name"), namespace=namespace, labels=meta.get("labels"),
                annotations=meta.get("annotations")))))
            ops = pod_patch(pod, namespace, rule, self.gpu_memory_mib)
        except fate.RuleError as exc:
            log.warning("pod %s/%s refused: %s", namespace, meta.get("name"), exc)
            response |= {"allowed": False, "status": {"code": 400, "message": str(exc)}}
            return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "response": response}
        if ops:
            response |= {"patchType": "JSONPatch", "patch": base64.b64encode(json.dumps(ops).encode()).decode()}
        log.info("pod %s/%s: %s", namespace, meta.get("name"), json.dumps(ops)[:400])
        return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "response": response}


def serve(webhook: Webhook, port: int, cert: str, key: str) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            if self.path.split("?")[0] != PATH:
                self.send_error(404)
                return
            try:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", "0"))))
                out = json.dumps(webhook.review(body)).encode()
            except Exception as exc:  # noqa: BLE001 - an API-server retry beats a dead webhook; say why
                log.exception("review failed")
                self.send_error(500, str(exc)[:200])
                return
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)

        def log_message(self, fmt: str, *args: Any) -> None:
            log.debug(fmt, *args)

    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    return server


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m e2e.lab.gpuwebhook", description=__doc__.splitlines()[0])
    parser.add_argument("--kubeconfig", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--cert", required=True)
    parser.add_argument("--key", required=True)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s", stream=sys.stderr)
    pool = load_pools().kubelet_pool()
    if pool.gpu is None:
        parser.error(f"pool {pool.name} has no GPU")
    api = config.new_client_from_config(config_file=args.kubeconfig)
    server = serve(Webhook(api, pool.gpu.memory_mib), args.port, args.cert, args.key)
    log.info("lab GPU webhook on https://127.0.0.1:%d%s for pool %s (%d MiB per GPU)", args.port, PATH, pool.name,
             pool.gpu.memory_mib)
    server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())

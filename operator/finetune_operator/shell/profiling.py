"""The shell of the pre-flight profile: reads the profile cache and the job's profile pod, and
writes a finished pod's measurements into the cache (the decisions are profiling/state.py's).

The cache is the ConfigMap `finetune-operator-profiles` in the operator's namespace (RBAC: get and
patch on it by name, create; the chart's `<fullname>-state` Role). Writes are JSON merge patches of
its data, so two replicas or two jobs of the same model never lose each other's entries.

Profile pods run in the operator's namespace too (profiling/pod.py; RBAC: the chart's
`<fullname>-profile` Role there, the only place the operator may create pods). Only a pod labelled
with the job's uid is read; a foreign pod with the profile pod's name is left for the lifecycle's
create to report (NameConflict), never read or deleted. No garbage collector removes a profile pod
whose job is deleted (an ownerReference cannot cross namespaces): `sweep` does.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Callable, Mapping

from kubernetes import client
from kubernetes.client.rest import ApiException

from finetune_trainer.contract import parse_profile_report

from .. import api
from ..profiling.cache import CACHE_CONFIGMAP, cache_entries, evictions, read_cache
from ..profiling.pod import (CONFIG_HASH_ANNOTATION, JOB_NAME_ANNOTATION, JOB_NAMESPACE_ANNOTATION, PLACEMENT_ANNOTATION,
                           PROFILE_CONTAINER,
                           PROFILE_UID_LABEL, is_profile_pod_of, profile_pod_name)
from ..profiling.setups import NotProfilable
from ..profiling.state import ProfileObservation, ProfilePod, asks_for_profile, needs_profile, observation

log = logging.getLogger("finetune_operator.profiling")
PROFILE_SELECTOR = f"{PROFILE_UID_LABEL},app.kubernetes.io/component=profile"
CACHE_WRITE_ATTEMPTS = 5


class ProfileShell:
    def __init__(self, cluster: Any, namespace: str, clock: Callable[[], float] = time.time) -> None:
        self.cluster = cluster  # cluster.Cluster: get_config_map, core
        self.namespace = namespace
        self.clock = clock  # stamps each model's `.written` entry, which orders evictions

    def observe(self, job: api.FineTuneJob, model_config: Mapping[str, Any] | None, trainer_image: str
                ) -> ProfileObservation | NotProfilable | None:
        """What the lifecycle needs to decide about the profile; None when the job needs none.
        `trainer_image` (the policy's) measures the profile and keys the cache."""
        config = needs_profile(job.spec, model_config, asked=asks_for_profile(job))
        if config is None:
            return None
        data = self._cache_data()
        seen = observation(job.spec, config, lambda digest, setups: read_cache(data, digest, setups), trainer_image)
        if isinstance(seen, NotProfilable):
            return seen
        pod = self._pod(job)
        if (pod is not None and pod.report is not None and pod.report.ok and pod.config_hash == seen.config_hash
                and seen.cached.missing):
            written_at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.clock()))
            data = self._write_cache(cache_entries(seen.config_hash, pod.report, written_at, seen.profile.setups()))
            seen = observation(job.spec, config, lambda digest, setups: read_cache(data, digest, setups), trainer_image)
            assert not isinstance(seen, NotProfilable)
        return dataclasses.replace(seen, pod=pod, pod_namespace=self.namespace)

    # -- the pod ---------------------------------------------------------------
    def _pod(self, job: api.FineTuneJob) -> ProfilePod | None:
        name = profile_pod_name(job.metadata.namespace or "default", job.metadata.name)
        try:
            body = self.cluster.core.read_namespaced_pod(name, self.namespace, _preload_content=False)
        except ApiException as error:
            if error.status == 404:
                return None
            raise
        pod = _as_dict(body)
        if not is_profile_pod_of(pod, job.metadata.uid):
            return None
        return pod_state(pod)

    def sweep(self) -> int:
        """Delete the profile pods whose job is gone (or was replaced: another uid under its name).
        The leader calls it now and then; returns how many it deleted."""
        pods = _as_dict(self.cluster.core.list_namespaced_pod(self.namespace, label_selector=PROFILE_SELECTOR,
                                                              _preload_content=False))
        deleted = 0
        for pod in pods.get("items") or []:
            meta = pod.get("metadata") or {}
            annotations = meta.get("annotations") or {}
            if not annotations.get(JOB_NAMESPACE_ANNOTATION) or not annotations.get(JOB_NAME_ANNOTATION):
                continue  # not a pod this operator rendered: not ours to judge
            job = self.cluster.get_job(annotations.get(JOB_NAMESPACE_ANNOTATION, ""), annotations.get(JOB_NAME_ANNOTATION, ""))
            if job is not None and is_profile_pod_of(pod, (job.get("metadata") or {}).get("uid")):
                continue
            try:
                self.cluster.core.delete_namespaced_pod(meta["name"], self.namespace, body=client.V1DeleteOptions(
                    preconditions=client.V1Preconditions(uid=meta.get("uid"))))
                deleted += 1
                log.info("deleted profile pod %s/%s: its job %s/%s is gone", self.namespace, meta["name"],
                         annotations.get(JOB_NAMESPACE_ANNOTATION), annotations.get(JOB_NAME_ANNOTATION))
            except ApiException as error:
                if error.status not in (404, 409):  # gone, or replaced since the list
                    raise
        return deleted

    # -- the cache ---------------------------------------------------------------
    def _cache_data(self) -> dict[str, str]:
        config_map = self.cluster.get_config_map(self.namespace, CACHE_CONFIGMAP)
        return dict((config_map or {}).get("data") or {})

    def _write_cache(self, entries: dict[str, str]) -> dict[str, str]:
        return merge_into_config_map(self.cluster, self.namespace, CACHE_CONFIGMAP, entries, "profile-cache",
                                     evict=evictions)


def merge_into_config_map(cluster: Any, namespace: str, name: str, entries: dict[str, str], component: str,
                          evict: Callable[[Mapping[str, str], Mapping[str, str]], dict[str, None]] | None = None
                          ) -> dict[str, str]:
    """Add `entries` to ConfigMap `name` (created when missing) with a JSON merge patch of its data.

    A merge patch only adds or replaces the keys it names, so two replicas (or two jobs) writing at
    once never lose each other's keys, and the operator needs no `update` on ConfigMaps. `evict`
    (data read, entries) names keys the same patch deletes (as nulls) to keep the ConfigMap under the
    API server's size limit. Returns the data after the write."""
    core = cluster.core
    for _ in range(CACHE_WRITE_ATTEMPTS):
        try:
            current = cluster.get_config_map(namespace, name)
            if current is None:
                body = {"apiVersion": "v1", "kind": "ConfigMap",
                        "metadata": {"name": name, "namespace": namespace,
                                     "labels": {"app.kubernetes.io/managed-by": "finetune-operator",
                                                "app.kubernetes.io/component": component}},
                        "data": dict(entries)}
                core.create_namespaced_config_map(namespace, body)
            else:
                evicted = evict(current.get("data") or {}, entries) if evict else {}
                if evicted:
                    log.info("ConfigMap %s/%s: %d keys evicted to stay under its size limit",
                             namespace, name, len(evicted))
                core.patch_namespaced_config_map(name, namespace, {"data": {**evicted, **entries}})
            return dict((cluster.get_config_map(namespace, name) or {}).get("data") or {})
        except ApiException as error:
            if error.status not in (404, 409):  # created or deleted by another writer since the read
                raise
    log.warning("ConfigMap %s/%s: gave up after %d conflicting writes", namespace, name, CACHE_WRITE_ATTEMPTS)
    return dict((cluster.get_config_map(namespace, name) or {}).get("data") or {})


def pod_state(pod: dict[str, Any]) -> ProfilePod:
    """The profile pod's phase, its report (termination message) and the kubelet's reason."""
    meta, status = pod.get("metadata") or {}, pod.get("status") or {}
    report, message = None, ""
    for container in status.get("containerStatuses") or []:
        if container.get("name") != PROFILE_CONTAINER:
            continue
        terminated = (container.get("state") or {}).get("terminated") or {}
        report = parse_profile_report(terminated.get("message"))
        if terminated and report is None:
            message = f"{terminated.get('reason') or 'terminated'} (exit code {terminated.get('exitCode')})"
    if not message and status.get("phase") == "Failed":
        message = f"{status.get('reason') or 'Failed'}: {status.get('message') or 'no message'}"
    unschedulable = ""
    for condition in status.get("conditions") or []:
        if condition.get("type") == "PodScheduled" and condition.get("status") == "False" \
                and condition.get("reason") == "Unschedulable":
            unschedulable = condition.get("message") or "no node fits"
    return ProfilePod(name=meta.get("name", ""), phase=status.get("phase") or "Pending",
                      config_hash=(meta.get("annotations") or {}).get(CONFIG_HASH_ANNOTATION, ""),
                      report=report, message=message, unschedulable=unschedulable,
                      placement=(meta.get("annotations") or {}).get(PLACEMENT_ANNOTATION, ""))


def _as_dict(response: Any) -> dict[str, Any]:
    import json

    if hasattr(response, "data"):
        return json.loads(response.data)
    return response

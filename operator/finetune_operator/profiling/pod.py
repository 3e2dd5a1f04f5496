"""The profile pod: the trainer image running `python -m finetune_trainer.profile`, bounded and CPU-only.

Bounds: `activeDeadlineSeconds` (the kubelet kills it after PROFILE_DEADLINE_SECONDS), CPU and
memory limits (fake tensors hold no data: the model's config and Python's own memory), no GPU
requested, no service-account token, no Secret, no volume but a scratch emptyDir, non-root with
every capability dropped, `HF_HUB_OFFLINE=1` (transformers never reaches for the Hub; the request
carries the config.json, so nothing needs fetching). The pod is pinned by required node affinity to
the regions the job may use, like every pod of the job, and takes the policy's `profilePod` node
selector and tolerations (the platform says where CPU-only work may land).

It runs in the operator's own namespace, not the job's: it needs nothing of the tenant's (no volume,
no Secret, its config.json travels in its environment), so the operator needs no right to create pods
in any tenant namespace (a right as good as reading every Secret there). An ownerReference cannot
cross namespaces, so the pod names its job by labels (PROFILE_UID_LABEL: the job's uid, what the shell
checks before it reads or deletes the pod) and annotations (namespace and name), and the shell
deletes it when done, and sweeps those whose job is gone. It carries no job/attempt label, so it is
never mistaken for a training pod.
"""

from __future__ import annotations

import json
from typing import Any

from finetune_trainer.contract import DEFAULT_REPORT_PATH, PROFILE_REQUEST_ENV, ProfileRequest

from .. import api
from ..planning.policy import ClusterPolicy
from ..rendering.names import label_value, short_hash
from ..rendering.pod import container_security_context, pod_security_context, scanner_skips, scratch_env

PROFILE_LABEL = "finetune.dev/profile-of"
# The job's uid: the profile pod's owner, which an ownerReference cannot name across namespaces.
PROFILE_UID_LABEL = "finetune.dev/profile-of-uid"
JOB_NAMESPACE_ANNOTATION = "finetune.dev/job-namespace"
JOB_NAME_ANNOTATION = "finetune.dev/job-name"
CONFIG_HASH_ANNOTATION = "finetune.dev/profile-config"
# A hash of where the pod may run (regions, the policy's profilePod settings): a pending pod placed
# by an older policy is replaced (profiling/state.py), one that runs is left to finish.
PLACEMENT_ANNOTATION = "finetune.dev/profile-placement"
PROFILE_CONTAINER = "profile"
PROFILE_DEADLINE_SECONDS = 1800
PROFILE_RESOURCES = {"requests": {"cpu": "1", "memory": "4Gi"}, "limits": {"cpu": "2", "memory": "8Gi"}}


def profile_pod_name(namespace: str, job_name: str) -> str:
    """`<job>-<hash of namespace/job>-profile`: profile pods of all namespaces share the operator's, so
    the name carries a hash of both (a DNS-1035 label, the job's name shortened when needed)."""
    base = "".join(c if c.isalnum() or c == "-" else "-" for c in job_name.lower()).lstrip("-0123456789") or "j"
    return f"{base[:40].rstrip('-')}-{short_hash(f'{namespace}/{job_name}')}-profile"


def is_profile_pod_of(pod: dict[str, Any], job_uid: str | None) -> bool:
    """Whether `pod` is the profile pod of the job with `job_uid` (by label: it has no ownerReference)."""
    meta = pod.get("metadata") or {}
    return bool(job_uid) and (meta.get("labels") or {}).get(PROFILE_UID_LABEL) == job_uid


def placement(job: api.FineTuneJob, policy: ClusterPolicy) -> dict[str, Any]:
    """The pod spec fields that say where the profile pod may run: the job's regions (those the policy
    allows) by required node affinity, and the policy's profilePod node selector and tolerations."""
    regions = [r for r in job.spec.placement.regions if r in set(policy.allowed_regions)]
    settings = policy.profile_pod
    return {
        "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchExpressions": [{"key": policy.region_label_key, "operator": "In", "values": regions}]}]}}},
        **({"nodeSelector": dict(settings.node_selector)} if settings.node_selector else {}),
        **({"tolerations": [t.to_pod() for t in settings.tolerations]} if settings.tolerations else {}),
    }


def placement_hash(job: api.FineTuneJob, policy: ClusterPolicy) -> str:
    return short_hash(json.dumps(placement(job, policy), sort_keys=True))


def render_profile_pod(job: api.FineTuneJob, request: ProfileRequest, config_hash: str,
                       policy: ClusterPolicy, namespace: str) -> dict[str, Any]:
    """The profile pod of `job`, in `namespace` (the operator's)."""
    job_namespace = job.metadata.namespace or "default"
    metadata: dict[str, Any] = {
        "name": profile_pod_name(job_namespace, job.metadata.name),
        "namespace": namespace,
        "labels": {
            "app.kubernetes.io/part-of": "finetune-operator",
            "app.kubernetes.io/managed-by": "finetune-operator",
            "app.kubernetes.io/component": "profile",
            PROFILE_LABEL: label_value(job.metadata.name),
            PROFILE_UID_LABEL: job.metadata.uid or "",
        },
        "annotations": {CONFIG_HASH_ANNOTATION: config_hash, PLACEMENT_ANNOTATION: placement_hash(job, policy),
                        JOB_NAMESPACE_ANNOTATION: job_namespace,
                        JOB_NAME_ANNOTATION: job.metadata.name,
                        # The chart's profile-pods NetworkPolicy selects it where the attempts get theirs.
                        **scanner_skips(credentials=False, network_policy=policy.network_policy.enabled)},
    }
    env = [
        {"name": PROFILE_REQUEST_ENV, "value": request.model_dump_json(by_alias=True, exclude_none=True)},
        {"name": "HF_HUB_OFFLINE", "value": "1"},
        {"name": "TRANSFORMERS_OFFLINE", "value": "1"},
        {"name": "CUDA_VISIBLE_DEVICES", "value": ""},
        *scratch_env(),  # HOME and the caches on the scratch emptyDir: the root filesystem is read-only
    ]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": metadata,
        "spec": {
            "restartPolicy": "Never",
            "activeDeadlineSeconds": PROFILE_DEADLINE_SECONDS,
            "automountServiceAccountToken": False,
            "enableServiceLinks": False,
            "securityContext": pod_security_context(),
            **placement(job, policy),
            "containers": [{
                "name": PROFILE_CONTAINER,
                # The policy's image, never the job's: the pod runs in the operator's namespace and its
                # report feeds the cache every tenant's jobs are sized from.
                "image": policy.trainer_image,
                "imagePullPolicy": "IfNotPresent",
                "command": ["python", "-m", "finetune_trainer.profile", f"--report-path={DEFAULT_REPORT_PATH}"],
                "env": env,
                "resources": {k: dict(v) for k, v in PROFILE_RESOURCES.items()},
                "securityContext": container_security_context(),
                "terminationMessagePolicy": "FallbackToLogsOnError",
                "volumeMounts": [{"name": "scratch", "mountPath": "/tmp"}],
            }],
            "volumes": [{"name": "scratch", "emptyDir": {"sizeLimit": "1Gi"}}],
        },
    }

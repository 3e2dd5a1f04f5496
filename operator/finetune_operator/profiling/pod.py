"""The profile pod: the trainer image running `python -m finetune_trainer.profile`, bounded and CPU-only.

Bounds: `activeDeadlineSeconds` (the kubelet kills it after PROFILE_DEADLINE_SECONDS), CPU and
memory limits (fake tensors hold no data: the model's config and Python's own memory), no GPU
requested, no service-account token, no Secret, no volume but a scratch emptyDir, non-root with
every capability dropped, `HF_HUB_OFFLINE=1` (transformers never reaches for the Hub; the request
carries the config.json, so nothing needs fetching). The pod is pinned by required node affinity to
the regions the job may use, like every pod of the job. It is a child of the FineTuneJob
(controller ownerReference): created and deleted ownership-checked by the shell, gone with the job.
It carries no job/attempt label, so it is never mistaken for a training pod.
"""

from __future__ import annotations

from typing import Any

from finetune_trainer.contract import DEFAULT_REPORT_PATH, PROFILE_REQUEST_ENV, ProfileRequest

from .. import api
from ..planning.policy import ClusterPolicy
from ..rendering.names import DNS1035_LABEL, label_value, short_hash
from ..rendering.pod import container_security_context, pod_security_context, scanner_skips, scratch_env
from ..rendering.renderer import owner_reference

PROFILE_LABEL = "finetune.dev/profile-of"
CONFIG_HASH_ANNOTATION = "finetune.dev/profile-config"
PROFILE_CONTAINER = "profile"
PROFILE_DEADLINE_SECONDS = 1800
PROFILE_RESOURCES = {"requests": {"cpu": "1", "memory": "4Gi"}, "limits": {"cpu": "2", "memory": "8Gi"}}


def profile_pod_name(job_name: str) -> str:
    """`<job>-profile` (a DNS-1035 label; shortened with a hash like attempt names when needed)."""
    plain = f"{job_name}-profile"
    if len(plain) <= 63 and DNS1035_LABEL.fullmatch(plain):
        return plain
    base = "".join(c if c.isalnum() or c == "-" else "-" for c in job_name.lower()).lstrip("-0123456789") or "j"
    return f"{base[:40].rstrip('-')}-{short_hash(job_name)}-profile"


def render_profile_pod(job: api.FineTuneJob, request: ProfileRequest, config_hash: str,
                       policy: ClusterPolicy) -> dict[str, Any]:
    regions = [r for r in job.spec.placement.regions if r in set(policy.allowed_regions)]
    owner = owner_reference(job)
    metadata: dict[str, Any] = {
        "name": profile_pod_name(job.metadata.name),
        "namespace": job.metadata.namespace,
        "labels": {
            "app.kubernetes.io/part-of": "finetune-operator",
            "app.kubernetes.io/managed-by": "finetune-operator",
            "app.kubernetes.io/component": "profile",
            PROFILE_LABEL: label_value(job.metadata.name),
        },
        "annotations": {CONFIG_HASH_ANNOTATION: config_hash, **scanner_skips(credentials=False)},
    }
    if owner is not None:
        metadata["ownerReferences"] = [owner]
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
            "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
                {"matchExpressions": [{"key": policy.region_label_key, "operator": "In", "values": regions}]}]}}},
            "containers": [{
                "name": PROFILE_CONTAINER,
                # Always the platform's image: its report feeds the cluster-wide cache (not the job's spec.image).
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

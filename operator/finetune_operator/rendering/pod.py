"""The data that fills the pod template: placement, resources, volumes, env, command.

Everything here is plain data (dicts and lists of strings and numbers); the template in
`templates/_pod_template.json.j2` fixes the shape around it.
"""

from __future__ import annotations

import math
from typing import Any

from .. import api
from ..planning import ClusterPolicy, Plan
from ..planning.pools import gpu_type_info, same_gpu_type
from ..planning.search.ask import UPLOAD_SIDECAR_HOST_BYTES
from ..planning.storage import StorageError, storage_regions
from . import layout as paths
from .errors import RenderError
from ..k8s_names import is_label_value, is_qualified_name
from .layout import Layout

GPU_RESOURCE = "nvidia.com/gpu"
MiB = 1024**2
# Share of a node's CPUs the pods of a full node request: the rest is left to the
# kubelet, the container runtime and daemon sets, which allocatable may not account for.
CPU_SHARE = 0.9
# When the catalog does not know a node's CPUs: what GPU nodes commonly have per GPU.
FALLBACK_CPUS_PER_GPU = 8
RUN_AS_USER = 1000
FETCH_CONTAINER = "fetch-model"
FETCH_DATA_CONTAINER = "fetch-data"
FETCH_EVAL_CONTAINER = "fetch-eval"
# The fetch init container of each role kept in object storage.
FETCH_CONTAINERS = {"model": FETCH_CONTAINER, "data": FETCH_DATA_CONTAINER, "eval": FETCH_EVAL_CONTAINER}
# The master pod's native sidecar that uploads the result to object storage (it alone holds the keys).
UPLOAD_CONTAINER = "upload"
# What the upload sidecar requests (and is limited to), beside the training container's: it copies
# files with boto3's managed transfer (8 MiB parts, 10 threads, waiting on the network far more than
# computing); its requests add to the pod's, so the planner counts its memory (planning/search/ask.py,
# UPLOAD_SIDECAR_HOST_BYTES) and its CPU comes out of the pod's share of the node (resources()). A
# whole CPU on top of that share left the master pod unschedulable on a node the plan fitted (the
# lab's real kubelet: "Insufficient cpu").
UPLOAD_CPU_MILLIS = 500
UPLOAD_RESOURCES = {"cpu": f"{UPLOAD_CPU_MILLIS}m", "memory": f"{UPLOAD_SIDECAR_HOST_BYTES // MiB}Mi"}
# The environment variables finetune_trainer.objectstore reads the access key pair from.
S3_ACCESS_KEY_ENV = "FINETUNE_S3_ACCESS_KEY_ID"
S3_SECRET_KEY_ENV = "FINETUNE_S3_SECRET_ACCESS_KEY"


def pinned_region(job: api.FineTuneJob, plan: Plan, policy: ClusterPolicy) -> str:
    """The one region the pods are pinned to: the plan's, checked once more against policy and job.

    An attempt runs in one region: the ranks of a multi-node attempt talk over the network
    every step, and its data must not cross the border either. The planner chooses the
    region; the renderer does not trust it blindly, because this check is the one thing
    that keeps the pods inside the allowed regions. A plan outside them is an error,
    never a reason to widen anything.
    """
    permitted = set(policy.allowed_regions) & set(job.spec.placement.regions)
    try:
        reachable = storage_regions(job.spec, policy)
    except StorageError as error:
        raise RenderError(error.path, error.message) from None
    if reachable is not None:
        # Object storage the job uses may be reached only from some of those regions (planning/storage.py).
        permitted &= set(reachable)
    regions = sorted(set(plan.allowed_regions))
    if not regions:
        raise RenderError("plan.allowedRegions", "empty; a pod must be pinned to a region")
    outside = [r for r in regions if r not in permitted]
    if outside:
        raise RenderError(
            "plan.allowedRegions",
            f"{outside} not allowed by both the cluster policy {sorted(policy.allowed_regions)}"
            f" and spec.placement.regions {list(job.spec.placement.regions)}"
            + ("" if reachable is None else f" and the job's object storage {sorted(reachable)}"),
        )
    if plan.region not in regions or plan.pool.region != plan.region:
        raise RenderError(
            "plan.region",
            f"pool {plan.pool.name} is in {plan.pool.region!r}, plan says {plan.region!r},"
            f" allowed regions are {regions}",
        )
    return plan.region


def gpu_requirement(plan: Plan) -> dict[str, Any]:
    """The node requirement that pins the pods to the plan's GPU type: the pool's GPU label.

    Pools of other GPU types may share a selector (one pool label over mixed nodes); the
    GPU label is what tells their nodes apart, so a plan for one type never lands on another.
    """
    pool = plan.pool
    where = f"pool {pool.name}.gpuLabel"
    if not same_gpu_type(plan.gpu_type, pool.gpu_type):
        raise RenderError("plan.gpuType", f"{plan.gpu_type!r}, but pool {pool.name} has {pool.gpu_type!r}")
    label = pool.gpu_label
    if label is None or not label.values:
        raise RenderError(
            where,
            f"the pool does not say how its nodes name their GPU ({pool.gpu_type} is not in the GPU table);"
            " the catalog must give gpuLabel.values",
        )
    if not is_qualified_name(label.key):
        raise RenderError(where, f"{label.key!r} is not a valid label key")
    for value in label.values:
        if not is_label_value(value):
            raise RenderError(where, f"{value!r} is not a valid label value; no node could carry it")
        known = gpu_type_info(value)
        if known is not None and not same_gpu_type(known.name, plan.gpu_type):
            raise RenderError(where, f"{value!r} names {known.name}, not the plan's {plan.gpu_type}")
    return {"key": label.key, "operator": "In", "values": sorted(label.values)}


def match_expressions(region_label_key: str, region: str, plan: Plan) -> list[dict[str, Any]]:
    """One required node-selector term: the plan's region, the plan's GPU, and the pool's labels.

    All expressions of a term must hold, so a pool label can only narrow what the region
    and GPU expressions allow; one that contradicts them is an error.
    """
    if not is_qualified_name(region_label_key):
        raise RenderError("policy.regionLabelKey", f"{region_label_key!r} is not a valid label key")
    gpu = gpu_requirement(plan)
    if gpu["key"] == region_label_key:
        raise RenderError(f"pool {plan.pool.name}.gpuLabel", f"{gpu['key']!r} is the region label")
    expressions = [{"key": region_label_key, "operator": "In", "values": [region]}, gpu]
    for key in sorted(plan.pool.selector):
        value = plan.pool.selector[key]
        if not is_qualified_name(key):
            raise RenderError(f"pool {plan.pool.name}.selector", f"{key!r} is not a valid label key")
        if key == region_label_key and value != region:
            # Discovery pins a pool that spans regions by region too; that must be the plan's region.
            raise RenderError(
                f"pool {plan.pool.name}.selector",
                f"selects region {value!r} on {key!r}, not the plan's region {region!r}",
            )
        if key == gpu["key"] and value not in gpu["values"]:
            raise RenderError(
                f"pool {plan.pool.name}.selector",
                f"selects GPU {value!r} on {key!r}, not one of the plan's {gpu['values']}",
            )
        expression = {"key": key, "operator": "In", "values": [value]}
        if expression not in expressions:  # the region again, say nothing twice
            expressions.append(expression)
    return expressions


def tolerations(plan: Plan) -> list[dict[str, Any]]:
    gpu_toleration = {"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}
    result: list[dict[str, Any]] = [gpu_toleration]
    for taint in plan.pool.taints:
        if not is_qualified_name(taint.key):
            raise RenderError(f"pool {plan.pool.name}.taints", f"{taint.key!r} is not a valid taint key")
        if taint.value is not None and not is_label_value(taint.value):
            raise RenderError(f"pool {plan.pool.name}.taints", f"value {taint.value!r} of {taint.key} is not a valid taint value")
        if taint.key == gpu_toleration["key"] and taint.effect == gpu_toleration["effect"]:
            continue  # already tolerated whatever its value
        if taint.value is None:
            result.append({"key": taint.key, "operator": "Exists", "effect": taint.effect})
        else:
            result.append({"key": taint.key, "operator": "Equal", "value": taint.value, "effect": taint.effect})
    return result


def resources(plan: Plan, beside_cpu_millis: int = 0) -> dict[str, str]:
    """The training container's requests, equal to limits: the pod gets Guaranteed QoS and the
    estimate's host memory. `beside_cpu_millis`: what the pod's other long-running containers (the
    upload sidecar) request, taken out of the pod's CPU share so that the pod as a whole still fits
    its share of the node. Whole CPUs for the trainer (the kubelet's static CPU manager pins only
    those)."""
    pool = plan.pool
    if plan.gpus_per_node > pool.gpus_per_node:
        raise RenderError("plan.gpusPerNode", f"{plan.gpus_per_node} exceeds the {pool.gpus_per_node} GPUs of pool {pool.name}")
    if pool.cpus > 0:
        share = pool.cpus * CPU_SHARE * plan.gpus_per_node / pool.gpus_per_node
    else:
        share = FALLBACK_CPUS_PER_GPU * plan.gpus_per_node
    cpus = math.floor(share - beside_cpu_millis / 1000)
    if plan.host_memory_bytes <= 0:
        raise RenderError("plan.hostMemoryBytes", "must be positive: the pod's memory request and limit come from it")
    return {
        GPU_RESOURCE: str(plan.gpus_per_node),
        "cpu": str(max(1, cpus)),
        "memory": f"{math.ceil(plan.host_memory_bytes / MiB)}Mi",
    }


def shm_size_limit(plan: Plan) -> str:
    """The bound of the memory-backed /dev/shm: half the pod's memory. What it holds counts against the
    container's memory limit anyway; the bound keeps a runaway writer from taking all of it."""
    return f"{max(64, math.ceil(plan.host_memory_bytes / 2 / MiB))}Mi"


def volumes(config_map_name: str, layout: Layout, plan: Plan) -> list[dict[str, Any]]:
    result: list[dict[str, Any]] = [
        {"name": "config", "configMap": {"name": config_map_name}},
        # NCCL and the data loader workers pass tensors through /dev/shm; the default 64 MiB is far too small.
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": shm_size_limit(plan)}},
        # HOME, /tmp and every cache the trainer writes (the root filesystem is read-only; see env()).
        {"name": "scratch", "emptyDir": {}},
    ]
    if layout.model is None:
        result.append({"name": "model", "emptyDir": {}})
    if layout.data is None:
        result.append({"name": "data", "emptyDir": {}})  # fetched from object storage
    if layout.eval_fetched:
        result.append({"name": "eval", "emptyDir": {}})  # spec.evaluation.dataset, fetched likewise
    if layout.output_in_empty_dir:
        # Uploaded to object storage after training; or, for a job with neither output nor
        # checkpoint volume (the API allows it: a smoke test), lost with the pod.
        result.append({"name": "output", "emptyDir": {}})
    if layout.upload is not None:
        # The training container's request and the upload sidecar's outcome: two small files.
        result.append({"name": "handoff", "emptyDir": {"sizeLimit": "1Mi"}})
    for mount in layout.claims:
        result.append(
            {"name": mount.role, "persistentVolumeClaim": {"claimName": mount.claim_name, "readOnly": mount.read_only}}
        )
    return result


def volume_mounts(layout: Layout) -> list[dict[str, Any]]:
    result: list[dict[str, Any]] = [
        {"name": "config", "mountPath": paths.CONFIG_DIR, "readOnly": True},
        {"name": "dshm", "mountPath": paths.SHM_DIR},
        {"name": "scratch", "mountPath": paths.SCRATCH_DIR},
    ]
    if layout.model is None:
        result.append({"name": "model", "mountPath": paths.MODEL_DIR, "readOnly": True})
    if layout.data is None:
        result.append({"name": "data", "mountPath": paths.DATA_DIR, "readOnly": True})
    if layout.eval_fetched:
        result.append({"name": "eval", "mountPath": paths.EVAL_DIR, "readOnly": True})
    if layout.output_in_empty_dir:
        result.append({"name": "output", "mountPath": paths.OUTPUT_DIR})
    if layout.upload is not None:
        result.append({"name": "handoff", "mountPath": paths.HANDOFF_DIR})
    for mount in layout.claims:
        result.append({"name": mount.role, "mountPath": mount.mount_path, "readOnly": mount.read_only})
    return result


def s3_credentials_env(location: api.S3Location) -> list[dict[str, Any]]:
    """The access key pair of a location, from its Secret: the values never appear in a manifest."""
    ref = location.credentials_secret_ref
    return [
        {"name": S3_ACCESS_KEY_ENV, "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.access_key_id_key}}},
        {"name": S3_SECRET_KEY_ENV, "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.secret_access_key_key}}},
    ]


def s3_arguments(transfer: paths.Transfer) -> list[str]:
    """The location as `--name=value` arguments: one list element each, so a value that starts
    with '-' is never read as an option and nothing is ever parsed by a shell."""
    location = transfer.location
    return [
        f"--endpoint={location.endpoint}",
        f"--bucket={location.bucket}",
        f"--key={transfer.key}",
        f"--signing-region={location.signing_region}",
    ]


def scratch_env() -> list[dict[str, Any]]:
    """HOME and the caches the trainer's libraries write, all on the scratch emptyDir at /tmp: the root
    filesystem is read-only (transformers/huggingface_hub, Triton's compiled kernels, torch.compile's
    inductor cache, DeepSpeed's JIT-built ops in torch extensions, and anything using XDG's cache)."""
    return [
        {"name": "HOME", "value": paths.SCRATCH_DIR},
        {"name": "HF_HOME", "value": f"{paths.SCRATCH_DIR}/huggingface"},
        {"name": "XDG_CACHE_HOME", "value": f"{paths.SCRATCH_DIR}/.cache"},
        {"name": "TRITON_CACHE_DIR", "value": f"{paths.SCRATCH_DIR}/.triton"},
        {"name": "TORCHINDUCTOR_CACHE_DIR", "value": f"{paths.SCRATCH_DIR}/torchinductor"},
        {"name": "TORCH_EXTENSIONS_DIR", "value": f"{paths.SCRATCH_DIR}/torch_extensions"},
    ]


def env(layout: Layout | None = None) -> list[dict[str, Any]]:
    """The training container's environment: never a credential (the transfers run in containers
    of their own, whose environment the training processes cannot read)."""
    return scratch_env() + [
        # The weights are local (on a volume, or fetched by the init container before
        # training starts): the trainer must never reach for the Hub.
        {"name": "HF_HUB_OFFLINE", "value": "1"},
        # Fewer, larger CUDA segments: less fragmentation than the sizing model allows for.
        {"name": "PYTORCH_CUDA_ALLOC_CONF", "value": "expandable_segments:True"},
    ]


def trainer_command(plan: Plan, layout: Layout | None = None, *, master: bool = True) -> list[str]:
    """The trainer's launcher: torchrun with the plan's shape (the training operator sets the
    rendezvous, PET_MASTER_ADDR, ...), exiting with the failure report's documented code
    rather than torchrun's blanket 1. On the master pod of a job whose output is in object
    storage, the launcher runs inside `finetune_trainer.objectstore train-and-hand-off`, which
    has the upload sidecar store the result once training has succeeded and succeeds only then."""
    launch = [
        "--config",
        f"{paths.CONFIG_DIR}/{paths.CONFIG_KEY}",
        f"--nnodes={plan.nodes}",
        f"--nproc-per-node={plan.gpus_per_node}",
    ]
    if layout is None or layout.upload is None or not master:
        return ["python", "-m", "finetune_trainer.launch", *launch]
    return ["python", "-m", "finetune_trainer.objectstore", "train-and-hand-off", f"--handoff={paths.HANDOFF_DIR}",
            "--", *launch]


def upload_sidecar(image: str, security_context: dict[str, Any], upload: paths.Transfer) -> dict[str, Any]:
    """The master pod's upload sidecar: a native sidecar (an init container with restartPolicy
    Always, Kubernetes 1.29+), started before the training container and stopped after it; it
    alone holds the key pair, and waits for the training container's request on the hand-off volume."""
    return {
        "name": UPLOAD_CONTAINER,
        "image": image,
        "imagePullPolicy": "IfNotPresent",
        "restartPolicy": "Always",
        "command": ["python", "-m", "finetune_trainer.objectstore", "upload-sidecar", *s3_arguments(upload),
                    f"--source={paths.OUTPUT_DIR}", f"--handoff={paths.HANDOFF_DIR}"],
        "env": scratch_env() + s3_credentials_env(upload.location),
        "volumeMounts": [
            {"name": "output", "mountPath": paths.OUTPUT_DIR, "readOnly": True},
            {"name": "handoff", "mountPath": paths.HANDOFF_DIR},
            {"name": "scratch", "mountPath": paths.SCRATCH_DIR},
        ],
        "resources": {"requests": dict(UPLOAD_RESOURCES), "limits": dict(UPLOAD_RESOURCES)},
        "securityContext": security_context,
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }


def init_containers(
    job: api.FineTuneJob,
    image: str,
    security_context: dict[str, Any],
    limits: dict[str, str],
    layout: Layout | None = None,
    *,
    master: bool = True,
) -> list[dict[str, Any]]:
    """Before training: download a Hub model's pinned revision, and fetch a model or data kept in
    object storage, each into the emptyDir of its role; on the master pod of a job whose output is
    in object storage, then the upload sidecar (it starts after the fetches and runs beside training)."""
    result: list[dict[str, Any]] = []
    common = {
        # Requests equal to limits, like the trainer's, so the pod keeps Guaranteed QoS.
        "resources": {"requests": dict(limits), "limits": dict(limits)},
        "securityContext": security_context,
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    hf = job.spec.model.source.hf
    if hf is not None:
        fetch_env = scratch_env()
        if hf.token_secret_ref is not None:
            fetch_env.append(
                {
                    "name": "HF_TOKEN",
                    "valueFrom": {"secretKeyRef": {"name": hf.token_secret_ref.name, "key": hf.token_secret_ref.key}},
                }
            )
        result.append(
            {
                "name": FETCH_CONTAINER,
                "image": image,
                "imagePullPolicy": "IfNotPresent",
                # `hf` is huggingface_hub's CLI, which transformers depends on; arguments are a list, never a shell line.
                "command": ["hf", "download", hf.repo, "--revision", hf.revision, "--local-dir", paths.MODEL_DIR],
                "env": fetch_env,
                "volumeMounts": [
                    {"name": "model", "mountPath": paths.MODEL_DIR},
                    {"name": "scratch", "mountPath": paths.SCRATCH_DIR},
                ],
                **common,
            }
        )
    for transfer in layout.fetches if layout is not None else ():
        result.append(
            {
                "name": FETCH_CONTAINERS[transfer.role],
                "image": image,
                "imagePullPolicy": "IfNotPresent",
                "command": [
                    "python", "-m", "finetune_trainer.objectstore", "fetch", *s3_arguments(transfer),
                    f"--dest={transfer.local_dir}", f"--phase={'load' if transfer.role == 'model' else 'data'}",
                ],
                "env": scratch_env() + s3_credentials_env(transfer.location),
                "volumeMounts": [
                    {"name": transfer.role, "mountPath": transfer.local_dir},
                    {"name": "scratch", "mountPath": paths.SCRATCH_DIR},
                ],
                **common,
            }
        )
    if layout is not None and layout.upload is not None and master:
        result.append(upload_sidecar(image, security_context, layout.upload))
    return result


def init_container_field(containers: list[dict[str, Any]]) -> str | None:
    """The spec field that asks for these init containers (the first in pod order), or None."""
    fields = {FETCH_CONTAINER: "spec.model.source", FETCH_DATA_CONTAINER: "spec.dataset.source",
              FETCH_EVAL_CONTAINER: "spec.evaluation.dataset", UPLOAD_CONTAINER: "spec.output"}
    return next((fields[c["name"]] for c in containers if c["name"] in fields), None)


# Findings of the policy scanner the tests run (checkov, tests/chart/test_checkov.py) that these pods
# keep on purpose, each skipped with its reason in checkov's inline form (an annotation of the pod).
SCANNER_SKIPS = {
    "CKV_K8S_8": "a batch training pod: no liveness probe, the operator watches the attempt and the trainer's report",
    "CKV_K8S_9": "a batch training pod serves nothing: no readiness probe",
    "CKV_K8S_15": "IfNotPresent: the trainer image is large and nodes keep it; a moved tag is allowedImages' requireDigest",
    "CKV_K8S_40": "runs as the trainer image's own user 1000, non-root under the restricted Pod Security Standard",
    "CKV_K8S_43": "the platform pins the trainer image; allowedImages requireDigest pins a job's own image",
}
# A pod no NetworkPolicy of ours selects: the profile pod (the operator's namespace), and training pods
# where the cluster policy turns the attempts' NetworkPolicies off (networkPolicy.enabled: false).
NO_NETWORK_POLICY_SKIP = ("CKV2_K8S_6", "no NetworkPolicy of the operator selects this pod (policy "
                          "networkPolicy.enabled false): the platform's namespace policy bounds it")
CREDENTIAL_SKIP = ("CKV_K8S_35", "the transfer containers (fetch, upload) take the key pair or Hub token from the "
                   "Secret as env, the training container never; files would be readable by every container of the pod")


def scanner_skips(credentials: bool, network_policy: bool) -> dict[str, str]:
    """The annotations that skip SCANNER_SKIPS (for a pod whose containers take credentials from a
    Secret, CREDENTIAL_SKIP; for one that no NetworkPolicy of the attempt selects, NO_NETWORK_POLICY_SKIP)."""
    skips = (list(SCANNER_SKIPS.items()) + ([CREDENTIAL_SKIP] if credentials else [])
             + ([] if network_policy else [NO_NETWORK_POLICY_SKIP]))
    return {f"checkov.io/skip{i}": f"{check}={reason}" for i, (check, reason) in enumerate(skips, start=1)}


def takes_credentials(containers: list[dict[str, Any]]) -> bool:
    return any("secretKeyRef" in (e.get("valueFrom") or {}) for c in containers for e in c.get("env") or [])


def pod_security_context() -> dict[str, Any]:
    return {
        "runAsNonRoot": True,
        "runAsUser": RUN_AS_USER,
        "runAsGroup": RUN_AS_USER,
        "fsGroup": RUN_AS_USER,
        # Only chown a volume whose root is not already ours: a model volume holds many large files.
        "fsGroupChangePolicy": "OnRootMismatch",
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def container_security_context() -> dict[str, Any]:
    """What the restricted Pod Security Standard asks of every container, and a read-only root
    filesystem: what the containers write goes to explicit emptyDirs (scratch at /tmp, dshm, the
    roles' volumes) or the job's volumes."""
    return {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}, "runAsNonRoot": True,
            "readOnlyRootFilesystem": True, "seccompProfile": {"type": "RuntimeDefault"}}


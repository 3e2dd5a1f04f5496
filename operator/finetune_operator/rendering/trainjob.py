"""Render attempt N of a FineTuneJob as a Kubeflow Trainer v2 TrainJob (trainer.kubeflow.org/v1alpha1).

The second backend beside the PyTorchJob of `renderer.render_attempt`; the attempt's ConfigMap is the
same object (`renderer.render_config_map`, same name and data), and every rule about the pods
(placement, tolerations, resources, environment, security, volumes, command) comes from `pod.py`, so
both backends pin, size and secure their pods by one rule.

Where each part of the pod goes in a TrainJob (checked against the CRD and Go types of the pinned
Trainer release, v2.3.0):

- `spec.trainer`: image, command, env, `numNodes` (the plan's nodes), `numProcPerNode` (its GPUs per
  node) and `resourcesPerNode` (requests = limits, as for the PyTorchJob). The trainer container's env
  can only be set here: runtime patches may not set env on the container named `node`.
- `spec.runtimePatches`: one entry under our own manager name (`PATCH_MANAGER`), patching the
  runtime's trainer job `node`: pod labels and annotations (the fake GPU and the operator find pods by
  them), the pod security context, the required node affinity (region, GPU product, pool), the
  tolerations, the volumes, and the `node` container's volume mounts and security context. A patch
  may only set what the API lists (`PodSpecPatch`, `ContainerPatch`): it cannot add init containers.
- What a patch cannot express is fixed by our ClusterTrainingRuntime (the chart's
  `trainJobRuntime`): `restartPolicy: Never`, no Job retries (`backoffLimit: 0`, JobSet
  `failurePolicy.maxRestarts: 0`), `enableServiceLinks: false`, the termination message path and
  `FallbackToLogsOnError`.
- `spec.suspend`: true for `spec.suspend` or a named queue (`kueue.x-k8s.io/queue-name` label on the
  TrainJob), exactly as for the PyTorchJob (`renderer.starts_suspended`).

`spec.trainer` is immutable once created, so a changed plan is a new TrainJob: one per attempt, named
like the PyTorchJob (`names.attempt_name`, a DNS-1035 label, which the TrainJob CRD also requires).
"""

from __future__ import annotations

from typing import Any, Mapping

from finetune_trainer.contract import DEFAULT_REPORT_PATH

from .. import api
from ..planning import ClusterPolicy, Plan
from . import pod
from .backend_interface import (Backend, Preflight, Prerequisite, ProgressSource, ReportsTrainerStatus, Suspendable,
                                conditions)
from .errors import RenderError
from .labels import common_labels, owner_reference
from .layout import layout_of, training_image
from .names import attempt_name
from .renderer import (
    JOB_NAME_ANNOTATION,
    MODEL_ANNOTATION,
    PLAN_ANNOTATION,
    PREDICTED_PEAK_ANNOTATION,
    QUEUE_LABEL,
    starts_suspended,
)

API_VERSION = "trainer.kubeflow.org/v1alpha1"
KIND = "TrainJob"
RUNTIME_API_GROUP = "trainer.kubeflow.org"
RUNTIME_KIND = "ClusterTrainingRuntime"
# The ClusterTrainingRuntime the chart ships (values `trainJobRuntime.name`).
DEFAULT_RUNTIME = "finetune-torch"
# Our entry in spec.runtimePatches (a list map keyed by manager; Kueue writes its own).
PATCH_MANAGER = "finetune.dev/operator"
# The trainer job of a torch runtime, and its container: the names Kubeflow Trainer gives them.
TRAINER_JOB = "node"
TRAINER_CONTAINER = "node"
# Where our runtime writes the container's termination message (the trainer's failure report).
REPORT_PATH = DEFAULT_REPORT_PATH
# The TrainJob CRD's bound on spec.trainer.image (a PyTorchJob's container image has none).
MAX_IMAGE_LENGTH = 500


def render_trainjob(
    job: api.FineTuneJob, plan: Plan, attempt: int, policy: ClusterPolicy, runtime: str = DEFAULT_RUNTIME
) -> dict[str, Any]:
    """The TrainJob of attempt `attempt` (from 1) of `job` under `plan`, referring to the
    ClusterTrainingRuntime `runtime`. Its pods mount the attempt's ConfigMap
    (`renderer.render_config_map`, the same name as the TrainJob), created first.

    Raises RenderError naming the field when the job or plan cannot be rendered, or needs what a
    TrainJob cannot express (an init container that fetches the model or the data).
    """
    if attempt < 1:
        raise RenderError("attempt", f"must be at least 1, got {attempt}")
    if not runtime or len(runtime) > 253:
        raise RenderError("runtime", f"{runtime!r} is not a ClusterTrainingRuntime name")
    name = attempt_name(job.metadata.name, attempt)
    layout = layout_of(job.spec, policy)
    region = pod.pinned_region(job, plan, policy)
    labels = common_labels(job, attempt)
    owner = owner_reference(job)
    image = training_image(job.spec, policy)
    if len(image) > MAX_IMAGE_LENGTH:
        raise RenderError(
            "spec.image" if job.spec.image else "policy.trainerImage",
            f"{len(image)} characters; a TrainJob's spec.trainer.image holds at most {MAX_IMAGE_LENGTH}",
        )
    limits = pod.resources(plan)
    container_security = pod.container_security_context()
    init_containers = pod.init_containers(
        job, image, container_security, {k: v for k, v in limits.items() if k != pod.GPU_RESOURCE}, layout
    )
    if init_containers:
        names = ", ".join(c["name"] for c in init_containers)
        raise RenderError(
            pod.init_container_field(init_containers) or "spec",
            f"needs the init container(s) {names}, which a TrainJob's runtime patch cannot add;"
            " use a volume (pvc), or the PyTorchJob backend",
        )

    object_labels = dict(labels)
    if job.spec.queue_name is not None:
        object_labels[QUEUE_LABEL] = job.spec.queue_name
    metadata: dict[str, Any] = {
        "name": name,
        "labels": object_labels,
        "annotations": {
            MODEL_ANNOTATION: job.spec.model.name,
            PLAN_ANNOTATION: plan.summary(),
            JOB_NAME_ANNOTATION: job.metadata.name,
        },
    }
    if job.metadata.namespace is not None:
        metadata["namespace"] = job.metadata.namespace
    if owner is not None:
        metadata["ownerReferences"] = [owner]

    pod_patch = {
        "metadata": {
            "labels": dict(labels),
            "annotations": {
                PREDICTED_PEAK_ANNOTATION: str(plan.predicted_peak_bytes),
                JOB_NAME_ANNOTATION: job.metadata.name,
                # No container of a TrainJob's pod takes a credential (it carries no transfer containers).
                **pod.scanner_skips(False, network_policy=policy.network_policy.enabled),
            },
        },
        "spec": {
            "securityContext": pod.pod_security_context(),
            "affinity": {
                "nodeAffinity": {
                    "requiredDuringSchedulingIgnoredDuringExecution": {
                        "nodeSelectorTerms": [
                            {"matchExpressions": pod.match_expressions(policy.region_label_key, region, plan)}
                        ]
                    }
                }
            },
            "tolerations": pod.tolerations(plan),
            "volumes": pod.volumes(name, layout, plan),
            "containers": [
                {
                    "name": TRAINER_CONTAINER,
                    "volumeMounts": pod.volume_mounts(layout),
                    "securityContext": container_security,
                }
            ],
        },
    }
    pod_patch = _as_go_writes_it(pod_patch)
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": metadata,
        "spec": {
            "runtimeRef": {"name": runtime, "apiGroup": RUNTIME_API_GROUP, "kind": RUNTIME_KIND},
            "suspend": starts_suspended(job.spec),
            "trainer": {
                "image": image,
                "command": pod.trainer_command(plan, layout),
                "env": pod.env(layout),
                "numNodes": plan.nodes,
                "numProcPerNode": plan.gpus_per_node,
                "resourcesPerNode": {"requests": dict(limits), "limits": dict(limits)},
            },
            "runtimePatches": [
                {
                    "manager": PATCH_MANAGER,
                    "trainingRuntimeSpec": {
                        "template": {
                            "spec": {
                                "replicatedJobs": [
                                    {"name": TRAINER_JOB, "template": {"spec": {"template": pod_patch}}}
                                ]
                            }
                        }
                    },
                }
            ],
        },
    }


def _as_go_writes_it(value: Any) -> Any:
    """The patch without what Go's `omitempty` drops (a `readOnly: false`, an empty list). Kueue admits a
    TrainJob by updating it through Go types, which write the patch back without those; Trainer's webhook
    then sees our runtime patch's containers and volumes changed and refuses the update as immutable
    ("field is immutable", seen on the lab), so the job was never un-suspended. Written as Go writes it,
    the patch reads back the same."""
    if isinstance(value, dict):
        return {k: _as_go_writes_it(v) for k, v in value.items()
                if not (k == "readOnly" and v is False) and not (isinstance(v, list) and not v)}
    if isinstance(value, list):
        return [_as_go_writes_it(v) for v in value]
    return value


def pod_template_patch(train_job: dict[str, Any]) -> dict[str, Any]:
    """Our runtime patch's pod template (metadata and spec) in a rendered or read-back TrainJob."""
    for patch in train_job.get("spec", {}).get("runtimePatches") or []:
        if patch.get("manager") != PATCH_MANAGER:
            continue
        for rjob in patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]:
            if rjob["name"] == TRAINER_JOB:
                return rjob["template"]["spec"]["template"]
    raise KeyError(f"no runtime patch of {PATCH_MANAGER} for the {TRAINER_JOB} job")


# ---------------------------------------------------------------------------
# The backend
# ---------------------------------------------------------------------------

# JobSet's and the Job controller's labels on a TrainJob's pods.
_JOBSET_REPLICATED_JOB = "jobset.sigs.k8s.io/replicatedjob-name"
_JOBSET_JOB_INDEX = "jobset.sigs.k8s.io/job-index"
_COMPLETION_INDEX = "batch.kubernetes.io/job-completion-index"


def trainjob_state(obj: Mapping[str, Any]) -> str:
    """From Trainer v2's conditions (Complete, Failed: copied from its JobSet) and, as a TrainJob has no
    Running condition, from `status.jobsStatus`: Running once a replicated job has all its pods ready
    (JobSet's `ready` counts such Jobs). Pending pods (unschedulable, pulling) are not Running, so the
    lifecycle's bounded waits see them as they do a PyTorchJob's."""
    found = conditions(obj)
    if found.get("Complete") == "True":
        return "Succeeded"
    if found.get("Failed") == "True":
        return "Failed"
    if (obj.get("spec") or {}).get("suspend"):
        return "Pending"
    for status in (obj.get("status") or {}).get("jobsStatus") or []:
        if (status.get("ready") or 0) > 0:
            return "Running"
    return "Pending"


def missing_runtime(policy: ClusterPolicy) -> str:
    """Why TrainJobs cannot be created when the policy's ClusterTrainingRuntime does not exist."""
    return (f"the ClusterTrainingRuntime {policy.train_job_runtime} that TrainJobs refer to does not exist "
            "(the chart installs it with trainJobRuntime.enabled)")


class TrainJobBackend(Suspendable, ProgressSource, ReportsTrainerStatus, Preflight, Backend):
    """No init containers: a runtime patch cannot add them (see the module docstring)."""

    name = "trainjob"
    group = RUNTIME_API_GROUP
    version = "v1alpha1"
    plural = "trainjobs"
    kind = KIND
    product = "Kubeflow Trainer v2 (TrainJob CRD) and the chart's ClusterTrainingRuntime (trainJobRuntime.enabled)"
    trainer_container = TRAINER_CONTAINER
    suspend_path = ("spec", "suspend")
    # Trainer v2.2+ writes what the pods POST to its status endpoint here (the TrainJobStatus gate).
    trainer_status_path = ("status", "trainerStatus")

    def render_job(self, job: api.FineTuneJob, plan: Plan, attempt: int, policy: ClusterPolicy) -> dict[str, Any]:
        return render_trainjob(job, plan, attempt, policy, policy.train_job_runtime)

    def state(self, obj: Mapping[str, Any]) -> str:
        return trainjob_state(obj)

    def is_rank0(self, labels: Mapping[str, str]) -> bool:
        """The first pod of the first Job of the TrainJob's JobSet (its node rank is the completion index)."""
        if _COMPLETION_INDEX not in labels:
            return False
        return (labels.get(_COMPLETION_INDEX) == "0" and labels.get(_JOBSET_JOB_INDEX, "0") == "0"
                and labels.get(_JOBSET_REPLICATED_JOB, TRAINER_JOB) == TRAINER_JOB)

    def prerequisite(self, policy: ClusterPolicy) -> Prerequisite:
        """The ClusterTrainingRuntime every TrainJob refers to."""
        return Prerequisite(RUNTIME_API_GROUP, self.version, "clustertrainingruntimes", policy.train_job_runtime,
                            missing_runtime(policy))


TRAIN_JOB = TrainJobBackend()

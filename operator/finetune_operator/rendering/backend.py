"""The training-job backends behind one small interface: what differs between a Kubeflow PyTorchJob
(training operator v1, `kubeflow.org/v1`) and a Kubeflow Trainer v2 TrainJob
(`trainer.kubeflow.org/v1alpha1`) lives here, so the lifecycle never names a backend.

A `Backend` says, for its kind:
- how an attempt is rendered (the ConfigMap is the same object on both; the training job differs),
- how the cluster shows the child's state (PyTorchJob conditions Succeeded/Failed/Running; TrainJob
  conditions Complete/Failed, and Running from its JobSet's ready jobs in `status.jobsStatus`),
- where its suspend switch is (`spec.runPolicy.suspend` vs `spec.suspend`),
- what it cannot run (a TrainJob cannot carry our fetch/upload init containers: runtime patches cannot
  add init containers, see trainjob.py).

`select_backend` is the one rule that picks the backend of a new attempt from the cluster policy's
`trainingBackend` (auto | pytorchjob | trainjob) and the kinds the API server serves. `auto` prefers
TrainJob when both are served (Kubeflow's direction: the training operator v1 is in maintenance), but
takes the PyTorchJob for a job that needs init containers when the cluster serves it.

Pure code: the shell (controller.py) finds the served kinds through API discovery and does the I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from .. import api
from ..planning import ClusterPolicy, Plan
from . import pod, renderer, trainjob
from .errors import RenderError
from .layout import layout_of
from .names import attempt_name

AUTO, PYTORCHJOB, TRAINJOB = "auto", "pytorchjob", "trainjob"


@dataclass(frozen=True)
class AttemptObjects:
    """What the operator creates for one attempt, in creation order (the pods mount the ConfigMap)."""

    name: str
    config_map: dict[str, Any]
    training_job: dict[str, Any]

    @property
    def objects(self) -> list[dict[str, Any]]:
        return [self.config_map, self.training_job]


@dataclass(frozen=True)
class Backend:
    """One kind of training job the operator can create for an attempt."""

    name: str  # the policy's value: pytorchjob | trainjob
    group: str
    version: str
    plural: str
    kind: str
    product: str  # what to install when the cluster does not serve it
    _render: Callable[[api.FineTuneJob, Plan, int, ClusterPolicy], dict[str, Any]]
    _state: Callable[[Mapping[str, Any]], str]
    _suspend_path: tuple[str, ...]  # where the suspend switch is, under the object

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}"

    @property
    def resource(self) -> str:
        """`<plural>.<group>`, as `kubectl api-resources` and RBAC name it."""
        return f"{self.plural}.{self.group}"

    def render(self, job: api.FineTuneJob, plan: Plan, attempt: int, policy: ClusterPolicy) -> AttemptObjects:
        """The attempt's ConfigMap and training job. Raises RenderError naming the field."""
        config_map, _ = renderer.render_config_map(job, plan, attempt, policy)
        return AttemptObjects(attempt_name(job.metadata.name, attempt), config_map, self._render(job, plan, attempt, policy))

    def state(self, obj: Mapping[str, Any]) -> str:
        """Succeeded, Failed, Running or Pending, from the object as the API shows it."""
        return self._state(obj)

    def suspended(self, obj: Mapping[str, Any]) -> bool:
        node: Any = obj
        for key in self._suspend_path:
            node = (node or {}).get(key) if isinstance(node, Mapping) else None
        return bool(node)

    def summary(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        """What the operator reads of a training job it keeps in memory (the informer's store): kind,
        metadata without managedFields, status, and of the spec only the suspend switch. The pod
        templates, three quarters of a PyTorchJob (17 of its 24 KB in memory), are never read back:
        at a thousand jobs they were the largest part of the operator's memory."""
        meta = obj.get("metadata") or {}
        return {"apiVersion": obj.get("apiVersion"), "kind": obj.get("kind"),
                "metadata": {k: v for k, v in meta.items() if k != "managedFields"},
                "status": obj.get("status") or {}, **self.suspend_patch(self.suspended(obj))}

    def suspend_patch(self, suspend: bool) -> dict[str, Any]:
        """The merge-patch body that sets the suspend switch."""
        body: dict[str, Any] = suspend  # type: ignore[assignment]
        for key in reversed(self._suspend_path):
            body = {key: body}
        return body


def _conditions(obj: Mapping[str, Any]) -> dict[str, str]:
    return {c.get("type"): c.get("status") for c in ((obj.get("status") or {}).get("conditions") or [])}


def pytorch_job_state(obj: Mapping[str, Any]) -> str:
    """From the training operator's conditions: Succeeded, Failed, Running, else Pending."""
    conditions = _conditions(obj)
    for state in ("Succeeded", "Failed", "Running"):
        if conditions.get(state) == "True":
            return state
    return "Pending"


def trainjob_state(obj: Mapping[str, Any]) -> str:
    """From Trainer v2's conditions (Complete, Failed: copied from its JobSet) and, as a TrainJob has no
    Running condition, from `status.jobsStatus`: Running once a replicated job has all its pods ready
    (JobSet's `ready` counts such Jobs). Pending pods (unschedulable, pulling) are not Running, so the
    lifecycle's bounded waits see them as they do a PyTorchJob's."""
    conditions = _conditions(obj)
    if conditions.get("Complete") == "True":
        return "Succeeded"
    if conditions.get("Failed") == "True":
        return "Failed"
    if (obj.get("spec") or {}).get("suspend"):
        return "Pending"
    for status in (obj.get("status") or {}).get("jobsStatus") or []:
        if (status.get("ready") or 0) > 0:
            return "Running"
    return "Pending"


def _render_pytorch_job(job: api.FineTuneJob, plan: Plan, attempt: int, policy: ClusterPolicy) -> dict[str, Any]:
    return renderer.render_attempt(job, plan, attempt, policy).pytorch_job


PYTORCH_JOB = Backend(
    name=PYTORCHJOB, group="kubeflow.org", version="v1", plural="pytorchjobs", kind="PyTorchJob",
    product="the Kubeflow training operator v1 (PyTorchJob CRD)",
    _render=_render_pytorch_job, _state=pytorch_job_state, _suspend_path=("spec", "runPolicy", "suspend"),
)
TRAIN_JOB = Backend(
    name=TRAINJOB, group=trainjob.RUNTIME_API_GROUP, version="v1alpha1", plural="trainjobs", kind=trainjob.KIND,
    product="Kubeflow Trainer v2 (TrainJob CRD) and the chart's ClusterTrainingRuntime (trainJobRuntime.enabled)",
    _render=lambda job, plan, attempt, policy: trainjob.render_trainjob(job, plan, attempt, policy, policy.train_job_runtime),
    _state=trainjob_state, _suspend_path=("spec", "suspend"),
)
BACKENDS: tuple[Backend, ...] = (PYTORCH_JOB, TRAIN_JOB)


def missing_runtime(policy: ClusterPolicy) -> str:
    """Why TrainJobs cannot be created when the policy's ClusterTrainingRuntime does not exist."""
    return (f"the ClusterTrainingRuntime {policy.train_job_runtime} that TrainJobs refer to does not exist "
            "(the chart installs it with trainJobRuntime.enabled)")


def backend_of_kind(kind: str) -> Backend | None:
    return next((b for b in BACKENDS if b.kind == kind), None)


class NoBackend(Exception):
    """No backend can run the job on this cluster now; the message says why and what to install."""

    def __init__(self, message: str, *, path: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.path = path  # a spec field when the job itself asks for what the only served backend cannot do


def needs_init_containers(job: api.FineTuneJob, policy: ClusterPolicy) -> str | None:
    """The spec field whose source needs an init container (hub or S3 fetch, S3 upload), or None."""
    try:
        layout = layout_of(job.spec, policy)
    except RenderError:
        return None  # rendering says what is wrong, naming the field
    containers = pod.init_containers(job, job.spec.image or policy.trainer_image, {}, {}, layout)
    if not containers:
        return None
    return "spec.model.source" if any(c["name"] == pod.FETCH_CONTAINER for c in containers) else "spec.dataset.source"


def select_backend(job: api.FineTuneJob, policy: ClusterPolicy, served: Sequence[Backend],
                   unusable: Mapping[str, str] | None = None) -> Backend:
    """The backend of the job's next attempt: the policy's `trainingBackend` among the `served` ones.
    `unusable` maps a served backend's name to why it cannot be used now (the TrainJob's
    ClusterTrainingRuntime does not exist).

    Raises NoBackend when the chosen kind is not served or not usable (the message names the CRD or
    runtime and what installs it), or when only a TrainJob is possible and the job needs init
    containers (its `path` is then the spec field)."""
    wanted = policy.training_backend
    unusable = dict(unusable or {})
    served_names = {b.name for b in served}
    if wanted in (PYTORCHJOB, TRAINJOB):
        backend = PYTORCH_JOB if wanted == PYTORCHJOB else TRAIN_JOB
        if backend.name not in served_names:
            raise NoBackend(f"the cluster policy's trainingBackend is {wanted}, but the API server does not serve "
                            f"{backend.resource}: install {backend.product}")
        if backend.name in unusable:
            raise NoBackend(f"the cluster policy's trainingBackend is {wanted}, but {unusable[backend.name]}")
        candidates = [backend]
    else:
        candidates = [b for b in (TRAIN_JOB, PYTORCH_JOB) if b.name in served_names and b.name not in unusable]
        if not candidates:
            why = "; ".join(unusable[b.name] for b in BACKENDS if b.name in served_names and b.name in unusable)
            raise NoBackend("the API server serves neither trainjobs.trainer.kubeflow.org nor pytorchjobs.kubeflow.org "
                            f"(trainingBackend auto): install {TRAIN_JOB.product}, or {PYTORCH_JOB.product}" if not why
                            else f"no training backend is usable (trainingBackend auto): {why}")
    field_ = needs_init_containers(job, policy)
    if field_ is None:
        return candidates[0]
    usable = [b for b in candidates if b is not TRAIN_JOB]
    if usable:
        return usable[0]
    raise NoBackend(
        f"needs an init container that fetches the model or the data (from the Hub or object storage), "
        f"which a TrainJob cannot carry (a runtime patch cannot add init containers), and the cluster runs "
        f"{'only TrainJobs' if wanted == AUTO else 'TrainJobs (trainingBackend: trainjob)'}: use a volume (pvc) source, "
        f"or a cluster with the PyTorchJob backend", path=field_)


# What a cluster serves when nothing else is known (the operator's first backend).
DEFAULT_SERVED: tuple[Backend, ...] = (PYTORCH_JOB,)

"""What a training backend is: one small required interface and a few optional capabilities.

A backend is one kind of training job the operator can create for an attempt (a Kubeflow
PyTorchJob, a Kubeflow Trainer v2 TrainJob). Like Kueue's jobframework (a small `GenericJob` plus
optional interfaces a job kind implements when it can), the operator asks every backend for the
same few things and asks a capability only of the backends that declare it:

required (`Backend`): its API coordinates (group, version, plural, kind), what to install when the
  cluster does not serve it, how an attempt's training job is rendered, how the job's state reads
  (Succeeded, Failed, Running, Pending), and the name of the pods' container that runs the trainer;
optional:
  `Suspendable`: where the job's suspend switch is (spec.suspend and queueing through Kueue need it);
  `CarriesInitContainers`: its pods may carry our fetch/upload init containers;
  `ProgressSource`: which of its pods is rank 0, whose log says how far training is;
  `ReportsTrainerStatus`: the job's own status may carry the trainer's progress report
  (TrainJob's status.trainerStatus, Kubeflow Trainer's TrainJobStatus gate);
  `Preflight`: a cluster object that must exist before the backend can be used (TrainJob's
  ClusterTrainingRuntime); the shell checks it, the lifecycle hears why not.

The concrete backends live in their own modules (`pytorchjob.py`, `trainjob.py`); `backend.py` is
the one registry that lists them and picks the backend of a new attempt. Nothing outside those
modules names a kind. Pure code: the shell does the I/O with the coordinates a backend gives.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from .. import api
from ..planning import ClusterPolicy, Plan
from . import network, renderer
from .names import attempt_name


@dataclass(frozen=True)
class AttemptObjects:
    """What the operator creates for one attempt, in creation order: the pods mount the ConfigMap,
    and the NetworkPolicy is there before any pod of the attempt is."""

    name: str
    config_map: dict[str, Any]
    training_job: dict[str, Any]
    network_policy: dict[str, Any] | None = None

    @property
    def objects(self) -> list[dict[str, Any]]:
        return [self.config_map, *([self.network_policy] if self.network_policy else []), self.training_job]


class Backend:
    """The required part: every backend sets these attributes and implements the two methods.

    One instance per kind (a module-level constant), so backends compare by identity."""

    name: str  # the cluster policy's trainingBackend value
    group: str
    version: str
    plural: str
    kind: str
    product: str  # what to install when the cluster does not serve it
    trainer_container: str  # the container of its pods that runs the trainer

    def render_job(self, job: api.FineTuneJob, plan: Plan, attempt: int, policy: ClusterPolicy) -> dict[str, Any]:
        """The attempt's training job. Raises RenderError naming the field."""
        raise NotImplementedError

    def state(self, obj: Mapping[str, Any]) -> str:
        """Succeeded, Failed, Running or Pending, from the object as the API shows it."""
        raise NotImplementedError

    # -- derived from the required part ------------------------------------------------------
    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}"

    @property
    def resource(self) -> str:
        """`<plural>.<group>`, as `kubectl api-resources` and RBAC name it."""
        return f"{self.plural}.{self.group}"

    def render(self, job: api.FineTuneJob, plan: Plan, attempt: int, policy: ClusterPolicy) -> AttemptObjects:
        """The attempt's ConfigMap and NetworkPolicy (the same objects on every backend) and training job."""
        config_map, _ = renderer.render_config_map(job, plan, attempt, policy)
        return AttemptObjects(attempt_name(job.metadata.name, attempt), config_map,
                              self.render_job(job, plan, attempt, policy),
                              network.render_network_policy(job, attempt, policy,
                                                            reports_status=isinstance(self, ReportsTrainerStatus)))

    def suspended(self, obj: Mapping[str, Any]) -> bool:
        """Whether the job's suspend switch is on (never, for a backend without one)."""
        return False

    def summary(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        """What the operator reads of a training job it keeps in memory (the informer's store): kind,
        metadata without managedFields, status, and of the spec only the suspend switch. The pod
        templates, three quarters of a PyTorchJob (17 of its 24 KB in memory), are never read back:
        at a thousand jobs they were the largest part of the operator's memory."""
        meta = obj.get("metadata") or {}
        kept = {"apiVersion": obj.get("apiVersion"), "kind": obj.get("kind"),
                "metadata": {k: v for k, v in meta.items() if k != "managedFields"},
                "status": obj.get("status") or {}}
        if isinstance(self, Suspendable):
            kept.update(self.suspend_patch(self.suspended(obj)))
        return kept

    def __repr__(self) -> str:
        return f"<backend {self.name}: {self.resource}>"


def value_at(obj: Mapping[str, Any], path: tuple[str, ...]) -> Any:
    """The value at `path` in a job object, or None where a key along it is missing."""
    node: Any = obj
    for key in path:
        node = node.get(key) if isinstance(node, Mapping) else None
    return node


class Suspendable:
    """Capability: the job has a suspend switch at `suspend_path` (spec.suspend, Kueue's admission)."""

    suspend_path: tuple[str, ...]

    def suspended(self, obj: Mapping[str, Any]) -> bool:
        return bool(value_at(obj, self.suspend_path))

    def suspend_patch(self, suspend: bool) -> dict[str, Any]:
        """The merge-patch body that sets the suspend switch."""
        body: dict[str, Any] = suspend  # type: ignore[assignment]
        for key in reversed(self.suspend_path):
            body = {key: body}
        return body


class CarriesInitContainers:
    """Capability: the job's pods may carry init containers (the model/data fetch, the output upload)."""


class ProgressSource:
    """Capability: the backend tells its rank-0 pod by the labels its controller sets."""

    def is_rank0(self, labels: Mapping[str, str]) -> bool:
        raise NotImplementedError


class ReportsTrainerStatus:
    """Capability: the job's controller takes a status from the training pods and keeps it in the
    job's own status (`trainer_status_path`), where the progress poller reads it from memory."""

    trainer_status_path: tuple[str, ...]

    def trainer_status(self, obj: Mapping[str, Any]) -> Any:
        return value_at(obj, self.trainer_status_path)


@dataclass(frozen=True)
class Prerequisite:
    """A cluster-scoped object that must exist before a backend can be used."""

    group: str
    version: str
    plural: str
    name: str
    missing: str  # why the backend cannot be used without it, and what installs it


class Preflight:
    """Capability: the backend needs a cluster object besides its CRD (the shell looks it up)."""

    def prerequisite(self, policy: ClusterPolicy) -> Prerequisite | None:
        raise NotImplementedError


def conditions(obj: Mapping[str, Any]) -> dict[str, str]:
    """The object's status conditions, type -> status."""
    return {c.get("type"): c.get("status") for c in ((obj.get("status") or {}).get("conditions") or [])}

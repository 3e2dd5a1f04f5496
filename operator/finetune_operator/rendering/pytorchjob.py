"""The PyTorchJob backend: Kubeflow training operator v1 (`kubeflow.org/v1`), the operator's first.

The job itself is rendered by `renderer.render_attempt` (the `pytorchjob.json.j2` template): a
Master replica and, for more than one node, Workers, whose container the training operator requires
to be called `pytorch`. Its pods may carry init containers, its suspend switch is
`spec.runPolicy.suspend`, and rank 0 is the Master replica.
"""

from __future__ import annotations

from typing import Any, Mapping

from .. import api
from ..planning import ClusterPolicy, Plan
from . import renderer
from .backend_interface import Backend, CarriesInitContainers, ProgressSource, Suspendable, conditions

# The training operator's labels on a replica's pods.
_REPLICA_TYPE = "training.kubeflow.org/replica-type"
_JOB_ROLE = "training.kubeflow.org/job-role"


def pytorch_job_state(obj: Mapping[str, Any]) -> str:
    """From the training operator's conditions: Succeeded, Failed, Running, else Pending."""
    found = conditions(obj)
    for state in ("Succeeded", "Failed", "Running"):
        if found.get(state) == "True":
            return state
    return "Pending"


class PyTorchJobBackend(Suspendable, CarriesInitContainers, ProgressSource, Backend):
    name = "pytorchjob"
    group = "kubeflow.org"
    version = "v1"
    plural = "pytorchjobs"
    kind = "PyTorchJob"
    product = "the Kubeflow training operator v1 (PyTorchJob CRD)"
    trainer_container = "pytorch"
    suspend_path = ("spec", "runPolicy", "suspend")

    def render_job(self, job: api.FineTuneJob, plan: Plan, attempt: int, policy: ClusterPolicy) -> dict[str, Any]:
        return renderer.render_attempt(job, plan, attempt, policy).pytorch_job

    def state(self, obj: Mapping[str, Any]) -> str:
        return pytorch_job_state(obj)

    def is_rank0(self, labels: Mapping[str, str]) -> bool:
        """The Master replica."""
        return labels.get(_REPLICA_TYPE, "").lower() == "master" or labels.get(_JOB_ROLE) == "master"


PYTORCH_JOB = PyTorchJobBackend()

"""The training backends' registry: which backends exist, and which one a new attempt uses.

A backend is one object behind the small interface of `backend_interface.py` (required: coordinates,
render, state, trainer container; optional capabilities: suspend, init containers, progress source,
preflight). The concrete ones live in their own modules, `pytorchjob.py` (Kubeflow training operator
v1) and `trainjob.py` (Kubeflow Trainer v2), and are listed once, here, in `BACKENDS`. Everything
else (the lifecycle, the shell, the informers, the classifier, the progress reader) goes through
this module and the interface, so nothing outside the backend modules names a kind.

`select_backend` is the one rule that picks the backend of a new attempt from the cluster policy's
`trainingBackend` (auto | one backend's name) and the kinds the API server serves. `auto` prefers
TrainJob when both are served (Kubeflow's direction: the training operator v1 is in maintenance), but
takes a backend whose pods can carry init containers for a job that needs them, when one is served.

Adding a backend: a module with its `Backend` subclass, its entry in `BACKENDS` (and `AUTO_ORDER`),
its name in the policy's `trainingBackend` values (planning/policy.py), and the chart's RBAC for its
resource.

Pure code: the shell (shell/cluster.py) finds the served kinds through API discovery and does the I/O.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from .. import api
from ..planning import ClusterPolicy
from . import pod
from .backend_interface import (
    AttemptObjects,
    Backend,
    CarriesInitContainers,
    Preflight,
    Prerequisite,
    ProgressSource,
    ReportsTrainerStatus,
    Suspendable,
)
from .errors import RenderError
from .layout import layout_of
from .pytorchjob import PYTORCH_JOB
from .trainjob import TRAIN_JOB

AUTO = "auto"

# Every backend, in the order discovery looks them up and the informers watch them.
BACKENDS: tuple[Backend, ...] = (PYTORCH_JOB, TRAIN_JOB)
# `trainingBackend: auto`: the first served and usable of these (Kubeflow's direction first).
AUTO_ORDER: tuple[Backend, ...] = (TRAIN_JOB, PYTORCH_JOB)
# What a cluster serves when nothing else is known (the operator's first backend).
DEFAULT_SERVED: tuple[Backend, ...] = (PYTORCH_JOB,)
DEFAULT_BACKEND: Backend = DEFAULT_SERVED[0]

__all__ = [
    "AUTO", "AUTO_ORDER", "BACKENDS", "DEFAULT_BACKEND", "DEFAULT_SERVED", "PYTORCH_JOB", "TRAIN_JOB", "AttemptObjects", "Backend",
    "CarriesInitContainers", "NoBackend", "Preflight", "Prerequisite", "ProgressSource", "ReportsTrainerStatus", "Suspendable",
    "backend_named", "backend_of_kind", "is_rank0", "may_choose", "needs_init_containers", "select_backend",
    "trainer_containers",
]


def backend_named(name: str) -> Backend | None:
    return next((b for b in BACKENDS if b.name == name), None)


def backend_of_kind(kind: str) -> Backend | None:
    return next((b for b in BACKENDS if b.kind == kind), None)


def may_choose(policy: ClusterPolicy, backend: Backend) -> bool:
    """Whether the policy's trainingBackend lets a new attempt use `backend` (auto, or its name)."""
    return policy.training_backend in (AUTO, backend.name)


def trainer_containers() -> tuple[str, ...]:
    """The containers that run the trainer, one per backend (the order the registry lists them)."""
    return tuple(dict.fromkeys(b.trainer_container for b in BACKENDS))


def is_rank0(labels: Mapping[str, str]) -> bool:
    """Whether a pod with these labels is rank 0 of its training job, by its backend's controller labels."""
    return any(b.is_rank0(labels) for b in BACKENDS if isinstance(b, ProgressSource))


class NoBackend(Exception):
    """No backend can run the job on this cluster now; the message says why and what to install."""

    def __init__(self, message: str, *, path: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.path = path  # a spec field when the job itself asks for what the only served backend cannot do


def needs_init_containers(job: api.FineTuneJob, policy: ClusterPolicy) -> str | None:
    """The spec field whose source needs an init container (hub or S3 fetch, the S3 upload sidecar), or None."""
    try:
        layout = layout_of(job.spec, policy)
    except RenderError:
        return None  # rendering says what is wrong, naming the field
    containers = pod.init_containers(job, job.spec.image or policy.trainer_image, {}, {}, layout)
    return pod.init_container_field(containers)


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
    chosen = backend_named(wanted)
    if chosen is not None:
        if chosen.name not in served_names:
            raise NoBackend(f"the cluster policy's trainingBackend is {wanted}, but the API server does not serve "
                            f"{chosen.resource}: install {chosen.product}")
        if chosen.name in unusable:
            raise NoBackend(f"the cluster policy's trainingBackend is {wanted}, but {unusable[chosen.name]}")
        candidates = [chosen]
    else:
        candidates = [b for b in AUTO_ORDER if b.name in served_names and b.name not in unusable]
        if not candidates:
            why = "; ".join(unusable[b.name] for b in BACKENDS if b.name in served_names and b.name in unusable)
            raise NoBackend(f"the API server serves neither {' nor '.join(b.resource for b in AUTO_ORDER)} "
                            f"(trainingBackend auto): install {', or '.join(b.product for b in AUTO_ORDER)}" if not why
                            else f"no training backend is usable (trainingBackend auto): {why}")
    field_ = needs_init_containers(job, policy)
    if field_ is None:
        return candidates[0]
    usable = [b for b in candidates if isinstance(b, CarriesInitContainers)]
    if usable:
        return usable[0]
    only = " and ".join(f"{b.kind}s" for b in candidates)
    raise NoBackend(
        f"needs an init container that fetches the model or the data (from the Hub or object storage) or uploads "
        f"the result (the upload sidecar), which a {candidates[0].kind} cannot carry (a runtime patch cannot add init "
        f"containers), and the cluster runs "
        f"{f'only {only}' if wanted == AUTO else f'{only} (trainingBackend: {wanted})'}: use a volume (pvc), "
        f"or a cluster with the {' or '.join(b.kind for b in BACKENDS if isinstance(b, CarriesInitContainers))} "
        "backend", path=field_)

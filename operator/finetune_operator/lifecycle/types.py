"""What `step` takes and gives: the shell's observation of one job, and the decision.

Also the intervals a decision asks to be looked at again after, and the bound on quoted evidence.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Mapping, Sequence

from .. import api
from ..children import Child
from ..planning.policy import ClusterPolicy
from ..planning.pools import NodePool
from ..rendering.backend import DEFAULT_SERVED, Backend
from ..sizing import ModelArchitecture


# How long to wait before planning again when nothing fits (pools may scale or free up).
REPLAN_AFTER_SECONDS = 60.0
# How often to look at a running attempt even when no event arrives.
RESYNC_SECONDS = 30.0
# How often to look again for an object the job refers to that does not exist yet.
WAITING_RETRY_SECONDS = 5.0
# How often to look again at a queued job whose Workload has not said yet why it waits.
QUEUE_RETRY_SECONDS = 3.0
# How often to look again at a job that something only a person can fix blocks.
BLOCKED_RETRY_SECONDS = 10.0
# Longest message of a failed pod kept in status.
MAX_EVIDENCE_MESSAGE = 512


@dataclass(frozen=True)
class ObjectRef:
    api_version: str
    kind: str
    name: str
    namespace: str | None = None  # None: the job's (a profile pod lives in the operator's)


@dataclass(frozen=True)
class Observed:
    """What the shell read from the cluster for one job."""

    job: api.FineTuneJob
    now: datetime
    policy: ClusterPolicy
    pools: Sequence[NodePool] = ()
    children: Sequence[Child] = ()  # every training job this FineTuneJob controls, any attempt
    pods: Sequence[dict[str, Any]] = ()  # of the job, every attempt (labelled with it)
    foreign: Sequence[ObjectRef] = ()  # objects holding the current attempt's names, not controlled by this job
    invalid: list[api.FieldProblem] | None = None  # problems found by the shell (e.g. a configMapRef)
    model_config: dict[str, Any] | None = None  # the config.json a configMapRef architecture points at
    waiting_for: str | None = None  # something the job refers to that does not exist yet (its configMapRef)
    architecture: ModelArchitecture | None = None  # resolved by `step`, not by the shell
    # The training-job kinds the API server serves (rendering/backend.py); a new attempt's kind is
    # chosen among them by the policy's trainingBackend. The lifecycle never names one.
    backends: Sequence[Backend] = DEFAULT_SERVED
    # The policy's defaultQueueName, when the job's namespace has that LocalQueue (the shell checks).
    default_queue: str | None = None
    # Served backends that cannot be used now, and why (the TrainJob's ClusterTrainingRuntime is missing).
    unusable: Mapping[str, str] = field(default_factory=dict)
    # For a model only the pre-flight profile can size: the cache and the profile pod, as the shell
    # read them (profiling.state.ProfileObservation, or NotProfilable naming what cannot be traced).
    profile: Any = None
    # The memory corrections the cluster learned (calibration.py), by kind of run; the shell reads them.
    learned: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Event:
    type: str  # Normal | Warning
    reason: str
    message: str


@dataclass
class Decision:
    status: api.FineTuneJobStatus
    create: list[dict[str, Any]] = field(default_factory=list)
    delete: list[ObjectRef] = field(default_factory=list)
    # Suspend (True) or resume (False) the current attempt's training job for spec.suspend. Only
    # ever False for a child the operator itself suspended: a queued child is never resumed here.
    set_suspend: bool | None = None
    events: list[Event] = field(default_factory=list)
    requeue_after: float | None = None  # seconds; None: wait for a change
    # Learned memory corrections this step changed (calibration.py), for the shell to store.
    learned: dict[str, Any] = field(default_factory=dict)

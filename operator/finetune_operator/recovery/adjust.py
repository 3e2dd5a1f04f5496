"""What the next attempt changes: the adjustment ladder.

For a GPU out-of-memory failure the estimate is first *calibrated* by what was observed:
the attempt needed more than the GPU has, so the true figure is at least
`capacity / predicted`, times a safety margin (and at least `(reported peak + the
allocation that failed) / predicted peak`, when the trainer or the log tail gave them, and
at least `planned GPU memory / capacity seen` when the process saw less than the pool
promises), never below what earlier failures taught.
Then the planner is asked again, with the calibrated estimate, allowing one more kind
of change per rung, in this documented order:

  1. gradientCheckpointing  turn activation recomputation on
  2. chunkedLoss            the cross-entropy over sequence chunks (the same loss)
  3. microBatch             smaller micro-batch, more accumulation (the global batch is kept)
  4. sharding               ddp -> fsdp / zero2 -> zero3
  5. activationOffloading   checkpointed activations to host memory (time, not results)
  6. optimizer8bit          the optimizer may switch to its counterpart (optimizers.py: AdamW and
                            bitsandbytes' 8-bit AdamW, torchao's 8-bit and 4-bit AdamW)
  7. offload                optimizer (and parameter) states to host memory
  8. optimizerInBackward    each parameter's step inside backward (no gradient clipping then)
  9. moreGPUs               more GPUs, or another pool, in the allowed regions
 10. masterWeights          bf16 weights, gradients and optimizer states (full fine-tuning)
 11. method                 LoRA -> QLoRA; only when `recovery.allowedAdjustments` lists `method`

The lean-trainer levers come in the order of what they give up: nothing (chunked loss),
time (activation offloading), gradient clipping (the step in backward), the low bits of
each update (bf16 master weights, only when more GPUs cannot help). The ladder frees
`masterWeights` and `optimizerInBackward` only where the job left them `auto`/unset: a job
that asks for fp32 master weights, or for no step in backward, keeps it.

Rungs the job does not allow are skipped. Each rung keeps the freedoms of the rungs
before it and adds its own: a freedom, never an obligation. The planner cannot choose the
optimizer itself (`training.optimizer` is a fixed field of its search), so from rung 4 on
each rung is planned once with the failed plan's optimizer and once with the other one,
and the two answers are ranked the way the planner ranks its own candidates (cheapest
within the cost tie, then free now, fewer GPUs, fewer nodes, fewer changes, where the
switch counts as a change). A later rung may so keep AdamW and use ZeRO with offload,
which bitsandbytes' 8-bit optimizers cannot run under. The answer is the cheapest change
that fits, found as early in the ladder as possible. Placement is never touched, so the
regions stay as allowed. When the optimizer changes, the next attempt cannot resume the
optimizer state of the checkpoint (other shapes, other dtypes): the trainer starts the
optimizer afresh from the checkpointed weights, and the change says so.

A host out-of-memory kill (OOMKilled, exit 137, or one torchrun worker killed by the
kernel) raises the pod's memory within what the node has; when that is exhausted and the
plan offloads to host memory, offload is turned off instead. Eviction and node loss run
the same plan again; when that plan can no longer be placed (its pool is gone or
changed), the job is re-planned elsewhere (`replan_after_loss`).

Recovery ends, with the reason in the answer, when the failure is one a retry cannot fix
(DataError, ConfigError, Unknown: classify.py says which evidence gives which), when
`recovery.maxAttempts` (or the policy's default) attempts were made, or when no allowed
change fits.

Two invariants hold for every plan this module proposes, whatever the failure:

* Never a plan that ran out of memory again. A plan that failed with a GPU OOM (its key,
  `PlanKey`: pool, shape, method, strategy, offload, optimizer, micro-batch,
  checkpointing) is never proposed again, in any form, nor spread differently over nodes
  (2 x 2 GPUs instead of 1 x 4: the same memory per GPU). A plan that failed with a host
  OOM is proposed again only with strictly more pod memory than it failed with (the GPU
  side of it was not at fault; pod memory is part of what ran). A plan that was evicted
  or lost its node did not fail by its own doing and may run again: that is what
  RETRY_SAME is for. `failed_runs` reads these facts from a job's attempt history; a bare
  `PlanKey` given instead counts as "never again", the stricter reading, except the failed
  plan's own key: a caller that lists every attempt lists the one that just failed too,
  and how that one failed is `failure`, known here.
* The calibration learned is never lost: every plan proposed carries a calibration at
  least as large as the failed plan's (and as the one the caller passes, e.g. the
  largest of the history, `learned_calibration`).

Where each part lives: the history's failed runs and learned calibration (history.py), the
rungs (ladder.py), a plan pinned to a spec (pinning.py), the answer and how a change reads
(next_step.py), and the remedies: after a loss (after_loss.py), a GPU OOM (gpu_oom.py), a
host OOM (host_oom.py). `decide_next` here picks among them.
"""

from __future__ import annotations

from typing import Sequence

from .. import api
from ..planning.plan import plan_key_of
from ..planning.policy import ClusterPolicy
from ..planning.pools import NodePool
from ..sizing import ModelArchitecture
from .after_loss import after_loss, replan_after_loss
from .classify import Failure, FailureKind, Remedy
from .gpu_oom import CALIBRATION_MARGIN, after_gpu_oom, calibration_factor
from .history import MEMORY_KINDS, MEMORY_OUTCOMES, Excluded, FailedRun, failed_runs, is_repeat, learned_calibration
from .host_oom import HOST_MEMORY_GROWTH, HOST_MEMORY_NODE_SHARE, after_host_oom
from .ladder import LADDER, Rung
from .next_step import AfterFailure, NextStep, describe_change
from .pinning import calibration_floor, pinned_spec, replan_pinned

__all__ = [
    "CALIBRATION_MARGIN",
    "HOST_MEMORY_GROWTH",
    "HOST_MEMORY_NODE_SHARE",
    "LADDER",
    "MEMORY_OUTCOMES",
    "Excluded",
    "FailedRun",
    "NextStep",
    "Rung",
    "calibration_factor",
    "decide_next",
    "describe_change",
    "failed_runs",
    "is_repeat",
    "learned_calibration",
    "pinned_spec",
    "replan_after_loss",
    "replan_pinned",
]


def decide_next(
    spec: api.FineTuneJobSpec,
    failure: Failure,
    failed: api.PlanStatus,
    *,
    attempts_made: int,
    failed_keys: Sequence[Excluded],
    pools: Sequence[NodePool],
    policy: ClusterPolicy,
    architecture: ModelArchitecture | None = None,
    calibration: float | None = None,
) -> NextStep:
    """The next attempt's plan after `failure` of the plan `failed`, or why there is none.

    `failed_keys`: what earlier attempts ruled out: `failed_runs(status.attempts)` (or bare
    PlanKeys, each then ruled out entirely). The failed plan itself is added here when
    `failure` is a memory failure, so the caller need not have recorded it yet.
    `calibration`: the largest calibration learned so far (`learned_calibration`), when
    the history knows more than `failed` does; the next plan never has less.
    `architecture`: the model's, when the spec refers to a ConfigMap (see `plan_job`)."""
    what = failure.describe()
    if failure.remedy is Remedy.GIVE_UP:
        return NextStep(False, None, "", f"{what}; a retry cannot fix this")
    max_attempts = spec.recovery.max_attempts or policy.default_max_attempts
    if attempts_made >= max_attempts:
        return NextStep(False, None, "", f"{what}; all {max_attempts} attempts are used")
    floor = calibration_floor(failed, calibration)
    own = plan_key_of(failed)
    # A bare key of the failed plan itself says no more than `failure` does (and, read as
    # "never again", would forbid running an evicted plan again or giving a host-OOM'd plan
    # more memory). Earlier failures of this very plan can only have been host OOMs with
    # less pod memory: after a GPU OOM it is never proposed again.
    excluded: list[Excluded] = [k for k in failed_keys if isinstance(k, FailedRun) or plan_key_of(k) != own]
    if failure.kind in MEMORY_KINDS:
        excluded.append(FailedRun.of(failed, failure.kind))
    after = AfterFailure(spec, failed, excluded, floor, pools, policy, what, architecture)
    if failure.remedy is Remedy.RETRY_SAME:
        return after_loss(after)
    if failure.kind is FailureKind.HOST_OUT_OF_MEMORY:
        return after_host_oom(after)
    return after_gpu_oom(after, failure)

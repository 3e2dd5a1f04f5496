"""What the cluster's runs teach the memory estimate (pure; the ConfigMap I/O is calibration_store.py).

A run's trainer reports the peak GPU memory it really allocated: on success (SuccessReport) and on
a GPU out-of-memory failure (FailureReport, a lower bound there). The attempt records it
(`observedPeak`) beside the plan's prediction (`predictedPeak`, the raw estimate). The operator
keeps one correction per kind of run, (GPU product, model family, method, strategy), and applies it
to later plans of the same kind: a new cluster plans with the built-in model; a cluster that has run
jobs plans tighter and safer.

Each kind is also keyed by the trainer image the runs ran (`Kind.image`): another image's trainer is
another trainer, and its figures teach nothing about this one. Only plausible figures are learned: a
run whose ratio is outside [MIN_PLAUSIBLE_RATIO, MAX_PLAUSIBLE_RATIO] (no estimate is that far off; a
figure like that is a broken or forged report) is refused and logged, and a stored factor outside
[MIN_FACTOR, MAX_FACTOR] is refused when read (logged), never clamped into use.

The rule, in one place:
* a kind's first run sets the factor to its ratio observed / predicted; each later run moves it by
  EWMA_WEIGHT towards the new ratio (an exponentially weighted moving average);
* the factor is bounded to [MIN_FACTOR, MAX_FACTOR]: never below 1.0 (the built-in model is the
  safety margin: a run that used less does not shrink it), and at most 1.5 (a run far above its
  prediction is a problem to look at, not a correction to trust blindly);
* a plan's calibration is the largest of what its own job's failures taught
  (`recovery.adjust.learned_calibration`, which never shrinks) and the learned factor of the kind the
  plan is: `plan_with_learning` plans, and when the winner's kind has learned more than the plan
  assumed, plans again with it (the factors only grow, so it ends within len(kinds) rounds).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import re
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping

from finetune_trainer.contract import SuccessReport, parse_success_report

from . import api
from .planning.plan import Plan

MIN_FACTOR = 1.0
MAX_FACTOR = 1.5
MIN_PLAUSIBLE_RATIO = 0.25
MAX_PLAUSIBLE_RATIO = 4.0
log = logging.getLogger("finetune_operator.calibration")
EWMA_WEIGHT = 0.3
# Outcomes whose observed peak says how much the plan really needed.
LEARNING_OUTCOMES = ("Succeeded", "GPUOutOfMemory")


@dataclass(frozen=True)
class Kind:
    gpu: str
    family: str
    method: str
    strategy: str
    image: str  # the trainer image the runs ran (the job's spec.image, else the policy's trainer image)

    @property
    def image_hash(self) -> str:
        return hashlib.sha256(self.image.encode()).hexdigest()[:12]

    @property
    def key(self) -> str:
        """A ConfigMap key ([-._a-zA-Z0-9]): gpu.family.method.strategy.<hash of the image>."""
        parts = (self.gpu, self.family, self.method, self.strategy)
        return ".".join([*(re.sub(r"[^-_a-zA-Z0-9]", "-", p) for p in parts), self.image_hash])

    def words(self) -> str:
        return f"{self.method} {self.strategy} {self.family} on {self.gpu}"


@dataclass(frozen=True)
class Learned:
    factor: float
    runs: int
    last_ratio: float

    def to_json(self) -> str:
        return json.dumps({"factor": round(self.factor, 4), "runs": self.runs, "lastRatio": round(self.last_ratio, 4)})

    @classmethod
    def from_json(cls, text: str) -> "Learned | None":
        try:
            data = json.loads(text)
            learned = cls(float(data["factor"]), int(data["runs"]), float(data.get("lastRatio", data["factor"])))
        except (ValueError, KeyError, TypeError):
            return None
        if not (math.isfinite(learned.factor) and learned.runs >= 0):
            return None
        if not MIN_FACTOR <= learned.factor <= MAX_FACTOR:
            log.warning("learned calibration %s refused: factor %s is outside [%s, %s]", text[:200],
                        learned.factor, MIN_FACTOR, MAX_FACTOR)
            return None
        return learned


def bounded(factor: float) -> float:
    return min(MAX_FACTOR, max(MIN_FACTOR, factor))


def update(previous: Learned | None, ratio: float) -> Learned:
    """The factor after one more run that used `ratio` times its predicted peak."""
    if not (ratio > 0 and math.isfinite(ratio)):
        raise ValueError(f"ratio: must be a positive number, got {ratio!r}")
    if previous is None or previous.runs == 0:
        return Learned(bounded(ratio), 1, ratio)
    return Learned(bounded(previous.factor + EWMA_WEIGHT * (ratio - previous.factor)), previous.runs + 1, ratio)


def kind_of(plan: api.PlanStatus | Any, family: str, image: str) -> Kind:
    return Kind(plan.gpu_type, family, plan.method, plan.strategy, image)


@dataclass(frozen=True)
class Observation:
    kind: Kind
    ratio: float
    attempt: int


def observations(before: api.FineTuneJobStatus | None, after: api.FineTuneJobStatus, family: str, image: str
                 ) -> list[Observation]:
    """Runs that ended with an observed peak in `after` and had not in `before`: each is learned once.
    `image` is the trainer image the job's pods run."""
    seen = {a.attempt for a in (before.attempts if before is not None else [])
            if a.outcome in LEARNING_OUTCOMES and a.observed_peak_gi_b}
    out = []
    for a in after.attempts:
        if a.attempt in seen or a.outcome not in LEARNING_OUTCOMES or a.plan is None:
            continue
        if not a.observed_peak_gi_b or not a.predicted_peak_gi_b:
            continue
        out.append(Observation(kind_of(a.plan, family, image), a.observed_peak_gi_b / a.predicted_peak_gi_b,
                               a.attempt))
    return out


def learn(table: Mapping[str, Learned], seen: Iterable[Observation]) -> dict[str, Learned]:
    """The entries `seen` changes (to merge into the store)."""
    changed: dict[str, Learned] = {}
    for obs in seen:
        if not (MIN_PLAUSIBLE_RATIO <= obs.ratio <= MAX_PLAUSIBLE_RATIO):
            log.warning("attempt %s of %s: observed / predicted peak %.4g is outside [%s, %s]; not learned",
                        obs.attempt, obs.kind.words(), obs.ratio, MIN_PLAUSIBLE_RATIO, MAX_PLAUSIBLE_RATIO)
            continue
        changed[obs.kind.key] = update(changed.get(obs.kind.key) or table.get(obs.kind.key), obs.ratio)
    return changed


def read_table(data: Mapping[str, str] | None) -> dict[str, Learned]:
    out = {}
    for key, text in (data or {}).items():
        learned = Learned.from_json(text)
        if learned is not None:
            out[key] = learned
    return out


def plan_with_learning(plan: Callable[[float], Any], base: float, table: Mapping[str, Learned], family: str,
                       image: str) -> tuple[Any, Learned | None, Kind | None]:
    """Plan with `base` (the job's own floor); while the winner's kind has learned a larger factor than
    the plan carries, plan again with it. Returns (result, the learned entry applied, its kind)."""
    factor, applied, applied_kind = base, None, None
    for _ in range(16):
        result = plan(factor)
        if not isinstance(result, Plan):
            return result, applied, applied_kind  # Infeasible
        kind = Kind(result.gpu_type, family, result.method, result.strategy, image)
        learned = table.get(kind.key)
        if learned is None or learned.factor <= factor + 1e-9:
            return result, applied, applied_kind
        factor, applied, applied_kind = learned.factor, learned, kind
    return result, applied, applied_kind


def applied_words(learned: Learned, kind: Kind) -> str:
    return (f"estimate x {learned.factor:.3g}: the correction learned from {learned.runs} run(s) of {kind.words()} "
            f"(observed / predicted peak; last {learned.last_ratio:.3g})")


def success_reports(pods: Iterable[Mapping[str, Any]], attempt: int, attempt_label: str) -> list[SuccessReport]:
    """The success reports the attempt's containers left in their termination messages."""
    reports = []
    for pod in pods:
        labels = (pod.get("metadata") or {}).get("labels") or {}
        if labels.get(attempt_label) != str(attempt):
            continue
        for container in (pod.get("status") or {}).get("containerStatuses") or []:
            terminated = (container.get("state") or {}).get("terminated") or {}
            report = parse_success_report(terminated.get("message"))
            if report is not None:
                reports.append(report)
    return reports


def success_peak_bytes(pods: Iterable[Mapping[str, Any]], attempt: int, attempt_label: str) -> int | None:
    """The highest peak allocated bytes the attempt's pods reported on success (None when none did)."""
    peaks = [r.peak_allocated_bytes for r in success_reports(pods, attempt, attempt_label) if r.peak_allocated_bytes]
    return max(peaks) if peaks else None

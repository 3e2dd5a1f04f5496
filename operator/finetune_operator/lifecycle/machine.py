"""The state machine's `step`: one look at a job, in the order the work happens: validate (or
wait, or profile first), agree with the children, then plan a new attempt or follow the current
one; and learn from the runs that ended."""

from __future__ import annotations

import dataclasses

from .. import api, calibration
from ..profiling import state as profiling
from ..rendering.errors import RenderError
from ..rendering.layout import layout_of
from ..sizing import SizingError, UnknownArchitecture
from ..sizing.from_job import architecture_of
from .adoption import reconcile_with_children
from .conditions import set_condition
from .follow import follow_attempt
from .launch import new_attempt
from .types import Decision, Observed
from .validation import architecture_problem, invalid, profile_first, profile_objects, waiting_for


def step(observed: Observed) -> Decision:
    job = observed.job
    status = (job.status or api.FineTuneJobStatus()).model_copy(deep=True)
    generation = job.metadata.generation
    decision = Decision(status=status)
    now = observed.now

    if status.phase in ("Succeeded", "Failed"):
        return decision  # terminal: nothing more to do

    problems = list(observed.invalid or [])
    try:
        # Sources the pods cannot read are the job's fault: say so now, not after planning. Object
        # storage endpoints are checked against the policy before the first attempt only: a policy
        # reload must not fail a job whose pods run on (later attempts are checked when rendered).
        layout_of(job.spec, observed.policy if status.current_attempt is None else None)
    except RenderError as error:
        problems.append(api.FieldProblem(path=error.path, message=error.message))
    if not problems and observed.waiting_for is not None:
        return waiting_for(decision, observed)
    if not problems:
        try:
            observed = dataclasses.replace(observed, architecture=architecture_of(job.spec, observed.model_config))
            if profiling.asks_for_profile(job):
                raise profiling.ProfileRequested(observed.architecture.family)
        except UnknownArchitecture as unknown:  # measured instead: the pre-flight profile (profiling/)
            resolved = profiling.resolve(job, observed.profile, unknown, observed.policy)
            if isinstance(resolved, profiling.ProfileStep):
                if resolved.failure is not None or status.current_attempt is None:
                    return profile_first(decision, observed, resolved)
                profile_objects(decision, observed, resolved)  # a running attempt runs on meanwhile
            else:
                observed = dataclasses.replace(observed, architecture=resolved.architecture)
                profile_objects(decision, observed, resolved)
        except SizingError as error:
            problems.append(architecture_problem(job.spec, error))
    if problems:
        return invalid(decision.status, problems, now, generation)
    set_condition(status, api.COND_VALIDATED, "True", "Valid", "the spec is valid", now, generation)
    status.observed_generation = generation

    reconcile_with_children(decision, observed)
    if status.current_attempt is None:
        return _learn(new_attempt(decision, observed, attempt=1, note=""), observed)
    return _learn(follow_attempt(decision, observed), observed)


def _learn(decision: Decision, observed: Observed) -> Decision:
    """Runs that ended this step with an observed peak teach the cluster's calibration (calibration.py)."""
    if observed.architecture is not None:
        seen = calibration.observations(observed.job.status, decision.status, observed.architecture.family,
                                        observed.policy.image_for(observed.job.spec.image))
        decision.learned = calibration.learn(observed.learned, seen)
    return decision

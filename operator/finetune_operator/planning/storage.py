"""Object storage and sovereignty: where a job that reads or writes S3-compatible storage may run.

The cluster policy lists every endpoint jobs may use (`objectStorage`), the region its data
lives in, and the regions whose pods may use it (`accessibleFrom`, only its own region unless
the platform team says more). A job's pods may run only in a region that

    the cluster policy allows  ∩  spec.placement.regions  ∩  every endpoint the job uses allows.

So data kept in Berlin's storage is trained on in Berlin, and a result is written to Paris's
storage only from a region Paris's entry lists: the policy, not the job, says whether data may
cross a border. An endpoint the policy does not list, or one that no region the job may use can
reach, makes the job invalid, naming the field; the planner and the renderer both narrow to the
regions computed here.
"""

from __future__ import annotations

from dataclasses import dataclass

from .. import api
from .policy import ClusterPolicy


class StorageError(ValueError):
    """A job's object storage the policy does not allow; `path` names the field."""

    def __init__(self, path: str, message: str) -> None:
        super().__init__(f"{path}: {message}")
        self.path = path
        self.message = message


@dataclass(frozen=True)
class StorageUse:
    """One place a job reads or writes in object storage."""

    path: str  # the spec field, e.g. spec.dataset.source.s3
    role: str  # model | data | evaluation data | output (for messages)
    location: api.S3Location


def storage_uses(spec: api.FineTuneJobSpec) -> list[StorageUse]:
    """Every S3 location of the job: its model, its data, its evaluation data, its output."""
    uses = []
    if spec.model.source.s3 is not None:
        uses.append(StorageUse("spec.model.source.s3", "model", spec.model.source.s3))
    if spec.dataset.source.s3 is not None:
        uses.append(StorageUse("spec.dataset.source.s3", "data", spec.dataset.source.s3))
    eval_source = spec.evaluation.dataset if spec.evaluation is not None else None
    if eval_source is not None and eval_source.s3 is not None:
        uses.append(StorageUse("spec.evaluation.dataset.s3", "evaluation data", eval_source.s3))
    if spec.output is not None and spec.output.s3 is not None:
        uses.append(StorageUse("spec.output.s3", "output", spec.output.s3))
    return uses


def storage_regions(spec: api.FineTuneJobSpec, policy: ClusterPolicy) -> list[str] | None:
    """The regions the job's pods may run in once its object storage is taken into account, in the
    order of spec.placement.regions; None when the job uses no object storage.

    Raises StorageError naming the endpoint field when the policy does not list an endpoint, or
    when no region the job may use (cluster policy ∩ spec.placement.regions) may reach it, or
    when its endpoints together leave no region. When the job and the policy have no region in
    common at all, that is the planner's to say (no region is allowed); only unknown endpoints
    are reported then.
    """
    uses = storage_uses(spec)
    if not uses:
        return None
    allowed = set(policy.allowed_regions)
    job_regions = [r for r in spec.placement.regions if r in allowed]
    regions = list(job_regions)
    for use in uses:
        field = f"{use.path}.endpoint"
        entry = policy.object_storage_for(use.location.endpoint)
        if entry is None:
            known = ", ".join(e.endpoint for e in policy.object_storage) or "none"
            raise StorageError(
                field,
                f"{use.location.endpoint} is not an object storage endpoint the cluster policy allows"
                f" (objectStorage lists: {known})",
            )
        if not job_regions:
            continue
        usable = entry.usable_regions
        if not any(r in usable for r in job_regions):
            raise StorageError(
                field,
                f"{entry.endpoint} keeps its data in {entry.region} and may be used from {', '.join(usable)} only;"
                f" this job may run in {', '.join(job_regions)} (cluster policy ∩ spec.placement.regions)",
            )
        narrowed = [r for r in regions if r in usable]
        if not narrowed:
            others = ", ".join(f"{u.path}.endpoint" for u in uses if u is not use)
            raise StorageError(
                field,
                f"{entry.endpoint} may be used from {', '.join(usable)} only, and {others} leaves"
                f" {', '.join(regions)}: no region may reach all of the job's object storage",
            )
        regions = narrowed
    return regions

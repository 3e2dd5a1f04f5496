"""The FineTuneJob object (metadata, spec, status), and reading one with errors that name each field."""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from .errors import FieldProblem, JobValidationError, merge_union_problems, problems_from
from .schema import API_VERSION, DNS1123_SUBDOMAIN
from .spec import FineTuneJobSpec
from .status import FineTuneJobStatus


class ObjectMeta(BaseModel):
    """The part of metadata the operator reads; everything else passes through."""

    model_config = ConfigDict(extra="allow")

    name: Annotated[str, Field(min_length=1, max_length=253)]
    namespace: str | None = None
    uid: str | None = None
    generation: int | None = None
    labels: dict[str, str] = {}
    annotations: dict[str, str] = {}

    @field_validator("name")
    @classmethod
    def _dns1123(cls, value: str) -> str:
        if not re.fullmatch(DNS1123_SUBDOMAIN, value):
            raise ValueError(
                "must be a DNS-1123 name: lower-case letters, digits, '-' and '.', starting and ending"
                " with a letter or digit"
            )
        return value


class FineTuneJob(BaseModel):
    """A fine-tuning run that the operator sizes, places and recovers from out-of-memory failures."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True, use_attribute_docstrings=True)

    api_version: Literal["finetune.dev/v1alpha1"] = Field(default=API_VERSION, alias="apiVersion")
    """finetune.dev/v1alpha1"""
    kind: Literal["FineTuneJob"] = "FineTuneJob"
    """FineTuneJob"""
    metadata: ObjectMeta
    """Standard object metadata."""
    spec: FineTuneJobSpec
    """What to fine-tune and where."""
    status: FineTuneJobStatus | None = None
    """Written by the operator."""


def parse_job(document: dict[str, Any]) -> FineTuneJob:
    """Validate a FineTuneJob document; raise JobValidationError naming each bad field."""
    if not isinstance(document, dict):
        raise JobValidationError([FieldProblem(path="(root)", message="a FineTuneJob must be a mapping")])
    try:
        return FineTuneJob.model_validate(document)
    except ValidationError as error:
        problems = problems_from(error)
        # A failed union (auto|int) reports once per member; keep the clearest.
        raise JobValidationError(merge_union_problems(problems)) from None


def parse_spec(spec: dict[str, Any]) -> FineTuneJobSpec:
    """Validate a bare spec (as a watch event carries it); paths start at `spec`."""
    try:
        return FineTuneJobSpec.model_validate(spec)
    except ValidationError as error:
        problems = [
            FieldProblem(path=f"spec.{p.path}" if p.path != "(root)" else "spec", message=p.message)
            for p in problems_from(error)
        ]
        raise JobValidationError(merge_union_problems(problems)) from None

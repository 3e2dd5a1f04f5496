"""The FineTuneJob API (finetune.dev/v1alpha1): the single source of truth.

The CRD in `crds/` is generated from these models (see `crd.py`), so every field's
docstring is what `kubectl explain` prints. Cross-field rules live twice by necessity:
as pydantic validators (the operator and the CLI) and, where CEL can say them, as
`x-kubernetes-validations` on the model (the API server, at `kubectl apply` time).
Both name the same field and say what is allowed; `tests/test_api_invalid.py` checks it.
"""

from __future__ import annotations

import re
from datetime import datetime
from typing import Annotated, Any, Literal, Union

from kubernetes.utils import parse_quantity
from pydantic import (
    AfterValidator,
    AliasChoices,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainSerializer,
    ValidationError,
    WithJsonSchema,
    field_validator,
    model_validator,
)
from pydantic.alias_generators import to_camel

from finetune_trainer.combinations import EXPORTS, STRATEGIES, Choices, cel_rules, first_violation
from finetune_trainer.failures import ATTEMPT_OUTCOMES
from finetune_trainer.memory_levers import choice_values, config_fields, ladder

from .schema import (
    ACCEPTS_KEY,
    API_VERSION,
    DNS1123_LABEL,
    DNS1123_SUBDOMAIN,
    GIT_REVISION,
    GROUP,
    KIND,
    LABEL_VALUE,
    MAX_GLOBAL_BATCH,
    MAX_GPUS,
    MAX_NAME,
    MAX_SEQUENCE_LENGTH,
    MAX_TEXT,
    PLURAL,
    PRINTABLE_LINE,
    SHORT_NAMES,
    SINGULAR,
    VERSION,
    ApiModel,
    AutoOrLossChunks,
    AutoOrMicroBatch,
    AutoOrPositiveInt,
    RelativePath,
    ShortName,
    Text,
    require_exactly_one,
    text_matching,
)
from .errors import (
    FieldError,
    FieldProblem,
    JobValidationError,
    field_error,
    merge_union_problems,
    problems_from,
)
from .sources import (
    S3_BUCKET,
    S3_ENDPOINT,
    S3_KEY,
    UNSUPPORTED_URI_MESSAGE,
    DataSource,
    HuggingFaceSource,
    ModelSource,
    OutputSpec,
    PvcSource,
    PvcTarget,
    S3CredentialsRef,
    S3Location,
    SecretDataKey,
    SecretKeyRef,
    UnsupportedUri,
)
from .model import ArchitectureSource, ConfigMapKeyRef, InlineArchitecture, ModelSpec, TextConfig
from .training import (
    Attention,
    Export,
    GpuType,
    LoraAdjustableModule,
    LoraSpec,
    MasterWeights,
    Method,
    Offload,
    Optimizer,
    Precision,
    ResourcesSpec,
    Strategy,
    TrainingSpec,
    UpdateRounding,
)
from .status import (
    COND_BLOCKED,
    COND_FAILED,
    COND_PLANNED,
    COND_QUEUED,
    COND_RECOVERING,
    COND_RUNNING,
    COND_SUCCEEDED,
    COND_SUSPENDED,
    COND_VALIDATED,
    AttemptOutcome,
    AttemptStatus,
    Condition,
    FineTuneJobStatus,
    GiBQuantity,
    Phase,
    PlanStatus,
    PodFailure,
    ProgressStatus,
    ProvenanceSummary,
    StatusModel,
    kube_time,
)
from .spec import (
    ADJUSTMENTS,
    CHOICE_PATHS,
    DEFAULT_ADJUSTMENTS,
    IMMUTABLE_FIELDS,
    Adjustment,
    BackoffSpec,
    CheckpointSpec,
    DatasetSpec,
    EarlyStoppingSpec,
    EvaluationSpec,
    FineTuneJobSpec,
    PlacementSpec,
    RecoverySpec,
    Region,
    spec_choices,
)

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


# ---------------------------------------------------------------------------
# Errors that name the field
# ---------------------------------------------------------------------------


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
    """Validate a bare spec (as kopf hands it over); paths start at `spec`."""
    try:
        return FineTuneJobSpec.model_validate(spec)
    except ValidationError as error:
        problems = [
            FieldProblem(path=f"spec.{p.path}" if p.path != "(root)" else "spec", message=p.message)
            for p in problems_from(error)
        ]
        raise JobValidationError(merge_union_problems(problems)) from None

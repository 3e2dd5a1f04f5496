"""The FineTuneJob API (finetune.dev/v1alpha1): the single source of truth.

The CRD in `crds/` is generated from these models (see `crd.py`), so every field's
docstring is what `kubectl explain` prints. Cross-field rules live twice by necessity:
as pydantic validators (the operator and the CLI) and, where CEL can say them, as
`x-kubernetes-validations` on the model (the API server, at `kubectl apply` time).
Both name the same field and say what is allowed; `tests/test_api_invalid.py` checks it.

The modules, by what they hold: `schema` (the API's names, the base model, bounds, patterns),
`sources` (volumes, object storage, the Hub and their Secrets), `model` (spec.model and the
typed config.json keys), `training` (method, lora, training, resources: the levers and the
strategy), `spec` (FineTuneJobSpec, its other sections and the rules across them), `status`,
`job` (FineTuneJob and parsing one) and `errors` (errors that name the field). Each imports
only those before it in this order: schema, errors, sources, model, training, status, spec, job.

Every public name of the API is here too (`api.FineTuneJobSpec`, `from finetune_operator.api
import parse_job`); the helpers the modules share (`schema.text_matching`, `errors.FieldError`,
...) are not.
"""

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
    AutoOrMicroBatch,
    AutoOrPositiveInt,
    RelativePath,
    ShortName,
    Text,
)
from .errors import FieldProblem, JobValidationError
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
    GpuType,
    LoraAdjustableModule,
    LoraSpec,
    Method,
    Offload,
    Optimizer,
    Precision,
    ResourcesSpec,
    Strategy,
    TrainingSpec,
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
    Export,
    FineTuneJobSpec,
    PlacementSpec,
    RecoverySpec,
    Region,
    spec_choices,
)
from .job import FineTuneJob, ObjectMeta, parse_job, parse_spec

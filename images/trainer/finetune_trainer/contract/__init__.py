"""The contract between the operator and the trainer (pydantic only: the operator imports it too).

What crosses the boundary between the operator and the training pods, one module a direction:

* `config`: `TrainerConfig` goes in (a ConfigMap mounted at `/etc/finetune/config.json`);
  `deepspeed`: the DeepSpeed config it carries for a ZeRO strategy.
* `reports`: what comes out: the failure report (the termination message), progress lines and
  Kubeflow Trainer's trainerStatus, the success report.
* `profiling`: the pre-flight profile's request and report.
* `base`: what they share (camelCase on the wire, the failure reasons and exit codes of the one
  failure vocabulary, `failures.py`).

Callers use the package's names (`contract.TrainerConfig`); nothing here is defined a second time
anywhere else.
"""

from __future__ import annotations

from ..failures import (  # noqa: F401  (the exit codes and the reported kinds are the contract's names too)
    EXIT_CONFIG_ERROR,
    EXIT_DATA_ERROR,
    EXIT_GPU_OOM,
    EXIT_HOST_OOM,
    EXIT_OK,
    EXIT_SIGKILL,
    EXIT_SIGTERM,
    EXIT_UNKNOWN,
    TRAINER_REPORTED,
)
from .base import (  # noqa: F401
    DEFAULT_CONFIG_PATH,
    DEFAULT_REPORT_PATH,
    EXIT_CODE_FOR_REASON,
    FailureReason,
    Phase,
    TERMINATION_MESSAGE_LIMIT,
    reason_for_exit_code,
)
from .config import (  # noqa: F401
    MICRO_BATCH_TOKENS_COUNT,
    CheckpointSettings,
    ConfigLoadError,
    DatasetSource,
    EarlyStopping,
    EvaluationSettings,
    FaultInjection,
    FsdpSettings,
    LoraSettings,
    ModelSource,
    Offload,
    Strategy,
    TrainerConfig,
    ZERO_STAGE,
    default_export,
    load_trainer_config,
)
from .deepspeed import (  # noqa: F401
    ZERO_SETTINGS,
    ZeroSettings,
    deepspeed_config,
)
from .reports import (  # noqa: F401
    ExportFacts,
    FailureReport,
    PROGRESS_EVENT,
    PROGRESS_LINE_LIMIT,
    ProgressReport,
    SuccessReport,
    TRAINER_STATUS_METRIC_LIMIT,
    TrainingFacts,
    last_progress,
    parse_failure_report,
    parse_progress_line,
    parse_success_report,
    progress_from_trainer_status,
    trainer_status_payload,
)
from .profiling import (  # noqa: F401
    PROFILE_PHASES,
    PROFILE_REQUEST_ENV,
    ProfileMeasurement,
    ProfileReport,
    ProfileRequest,
    ProfileSetup,
    ProfileShape,
    parse_profile_report,
)

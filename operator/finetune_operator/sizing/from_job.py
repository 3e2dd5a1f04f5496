"""From a FineTuneJob to the TrainingSetup that sizing estimates.

`estimate` sizes exactly what a job fixes. Fields the job leaves `auto` (the planner
searches those) get the documented defaults below, and each one used is named in the
notes so nobody mistakes the figure for the plan's:

* resources.gpus auto -> 1
* resources.strategy auto -> ddp on one GPU or with qlora, fsdp on more
* training.microBatchSize auto -> 1
* training.gradientCheckpointing unset -> true
* resources.offload auto -> none
* training.masterWeights auto -> fp32, optimizerInBackward / activationOffloading unset -> off,
  lossChunks auto -> 8 (1 for models that transform their logits after the head)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from finetune_trainer.memory_levers import sized_fields

from .architecture import ModelArchitecture
from .errors import SizingError
from .presets import preset
from .setup import TrainingSetup

DEFAULT_GPUS = 1
DEFAULT_MICRO_BATCH = 1
DEFAULT_CHECKPOINTING = True
DEFAULT_OFFLOAD = "none"


@dataclass(frozen=True)
class JobSetup:
    """The setup of a job, and the notes on the `auto` fields it had to fill in."""

    setup: TrainingSetup
    notes: tuple[str, ...]


def architecture_of(spec: Any, model_config: Mapping[str, Any] | None = None) -> ModelArchitecture:
    """The job's architecture: a preset, inline numbers, or a config.json the caller read from its ConfigMap."""
    source = spec.model.architecture
    if source.preset is not None:
        return preset(source.preset)
    if source.inline is not None:
        config = source.inline.config_json()
        return ModelArchitecture.from_hf_config(config, name=spec.model.name)
    if model_config is None:
        ref = source.config_map_ref
        raise SizingError(
            "spec.model.architecture.configMapRef",
            f"the architecture is in ConfigMap {ref.name!r} (key {ref.key!r}); pass its config.json "
            "(the CLI's --model-config FILE) to size it",
        )
    return ModelArchitecture.from_hf_config(model_config, name=spec.model.name)


def config_json_of(spec: Any, model_config: Mapping[str, Any] | None = None) -> dict[str, Any] | None:
    """The job's config.json as a dict, whatever the source: the pasted one (every key kept),
    the ConfigMap's (which the caller read), or a preset's. None when a ConfigMap's is not read yet.

    This is what the pre-flight profile builds the model from when sizing raises UnknownArchitecture.
    """
    source = spec.model.architecture
    if source.preset is not None:
        return preset(source.preset).to_hf_config()
    if source.inline is not None:
        return source.inline.config_json()
    return dict(model_config) if model_config is not None else None


def setup_from_job(job: Any, model_config: Mapping[str, Any] | None = None) -> JobSetup:
    """Map a FineTuneJob (api.FineTuneJob or its spec) to a TrainingSetup."""
    spec = getattr(job, "spec", job)
    arch = architecture_of(spec, model_config)
    res, training = spec.resources, spec.training
    notes: list[str] = []

    gpus = res.gpus
    if gpus == "auto":
        gpus = DEFAULT_GPUS
        notes.append(f"resources.gpus is auto: sized for {gpus} GPU (the planner searches the count)")
    strategy = res.strategy
    if strategy == "auto":
        strategy = "ddp" if gpus == 1 or spec.method == "qlora" else "fsdp"
        notes.append(f"resources.strategy is auto: sized with {strategy}")
    micro = training.micro_batch_size
    if micro == "auto":
        micro = DEFAULT_MICRO_BATCH
        notes.append(f"training.microBatchSize is auto: sized with {micro}")
    checkpointing = training.gradient_checkpointing
    if checkpointing is None:
        checkpointing = DEFAULT_CHECKPOINTING
        notes.append("training.gradientCheckpointing is unset: sized with checkpointing on")
    offload = res.offload
    if offload == "auto":
        offload = DEFAULT_OFFLOAD
        notes.append("resources.offload is auto: sized without offload")

    # The levers a job fixes; `auto` ones get the plain setting (the planner searches them), except
    # the chunked loss, whose `auto` is always 8 chunks where the model allows it (Lever.sized).
    levers = sized_fields(training, spec.method, arch, notes)

    lora_kwargs: dict[str, Any] = {}
    if spec.method != "full":
        targets = tuple(spec.lora.target_modules)
        lora_kwargs = dict(
            lora_rank=spec.lora.rank,
            lora_targets="all-linear" if targets == ("all-linear",) else targets,
            lora_dropout=spec.lora.dropout,
            lora_modules_to_save=tuple(spec.lora.modules_to_save),
        )
    setup = TrainingSetup(
        architecture=arch,
        method=spec.method,
        precision=training.precision,
        optimizer=training.optimizer,
        micro_batch_size=micro,
        sequence_length=training.sequence_length,
        gradient_checkpointing=checkpointing,
        attention=training.attention,
        packing=spec.dataset.packing,
        padding_free=spec.dataset.padding_free,
        micro_batch_tokens=tuple(spec.dataset.micro_batch_tokens or ()),
        strategy=strategy,
        world_size=gpus,
        offload=offload,
        lora_target_experts=bool(spec.lora is not None and spec.lora.target_experts and spec.method != "full"),
        **levers,
        **lora_kwargs,
    )
    return JobSetup(setup, tuple(notes))

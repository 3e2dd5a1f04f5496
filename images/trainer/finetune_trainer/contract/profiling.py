"""The pre-flight profile's request (an environment variable of the profile pod) and its report
(the termination message)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, ValidationError

from .base import Contract, TERMINATION_MESSAGE_LIMIT, json_object


# --------------------------------------------------------- pre-flight profile
#
# The operator runs `python -m finetune_trainer.profile` in a CPU-only pod for a model whose
# family the analytic memory model does not know. The request goes in as the environment
# variable PROFILE_REQUEST_ENV (compact JSON); the report comes out in the termination message.

PROFILE_REQUEST_ENV = "FINETUNE_PROFILE_REQUEST"
PROFILE_PHASES = ("forward", "backward", "optimizer")


class ProfileSetup(Contract):
    """One training setup the profile traces: what the trainer would run on `worldSize` GPUs."""

    method: Literal["full", "lora"]
    lora_rank: int = Field(16, ge=1)
    lora_alpha: float = Field(32, gt=0)
    lora_dropout: float = Field(0.0, ge=0, lt=1)
    lora_targets: Literal["all-linear"] | list[str] = "all-linear"
    # peft's modules_to_save (spec.lora.modulesToSave), trained in fp32 as the trainer trains them;
    # None (left out of the request, for a trainer image that predates it): none.
    lora_modules_to_save: list[str] | None = None
    precision: Literal["bf16", "fp32"] = "bf16"
    attention: Literal["sdpa", "eager"] = "sdpa"
    packing: bool = Field(False, description="examples packed with their boundaries (spec.dataset.packing)")
    sequence_length: int = Field(ge=1)
    micro_batch_size: int = Field(ge=1)
    gradient_checkpointing: bool
    strategy: Literal["ddp", "fsdp"]
    world_size: int = Field(ge=1)

    @property
    def key(self) -> str:
        """Stable and short: the cache key of this setup (with the config's hash)."""
        targets = self.lora_targets if isinstance(self.lora_targets, str) else "+".join(self.lora_targets)
        lora = f"r{self.lora_rank}a{self.lora_alpha:g}d{self.lora_dropout:g}t{targets}" if self.method == "lora" else ""
        if self.method == "lora" and self.lora_modules_to_save:  # without: keys as before, the cache stays valid
            lora += "m" + "+".join(self.lora_modules_to_save)
        return (f"{self.method}{lora}.{self.precision}.{self.attention}.s{self.sequence_length}"
                f".b{self.micro_batch_size}.gc{int(self.gradient_checkpointing)}.{self.strategy}{self.world_size}"
                + (".packed" if self.packing else ""))  # unpacked keys as before: the cache stays valid


class ProfileRequest(Contract):
    config: dict[str, Any] = Field(description="The model's config.json, as the job gives it")
    model_path: str | None = Field(None, description="The model's directory (only to import its code)")
    trust_remote_code: bool = False
    setups: list[ProfileSetup] = Field(min_length=1)


class ProfileMeasurement(Contract):
    key: str  # ProfileSetup.key
    peaks: dict[str, int]  # per phase (PROFILE_PHASES), peak allocated bytes of the second step
    trainable_params: int = Field(ge=0)
    ddp_bucket_bytes: int = Field(0, ge=0)  # what DDP's reducer adds on more than one rank
    seconds: float = Field(0.0, ge=0)


class ProfileShape(Contract):
    """The numbers transformers' config gives (under its standard attribute names)."""

    model_type: str
    hidden_size: int = Field(ge=1)
    num_layers: int = Field(ge=1)
    vocab_size: int = Field(ge=1)
    num_attention_heads: int = Field(ge=1)
    num_key_value_heads: int = Field(ge=1)
    head_dim: int = Field(ge=1)
    intermediate_size: int = Field(ge=1)
    tie_word_embeddings: bool = False


class ProfileReport(Contract):
    """What the profile pod writes to its termination message: measured peaks per setup, or why not."""

    ok: bool
    error: str = ""  # why the model could not be built or traced (ok false)
    error_field: str = ""  # the job field to blame, when one is (e.g. spec.lora.targetModules)
    shape: ProfileShape | None = None
    params: dict[str, int] = Field(default_factory=dict)  # total, embedding, lmHead (0 when tied), trainable
    measurements: list[ProfileMeasurement] = Field(default_factory=list)

    def to_termination_message(self, limit: int = TERMINATION_MESSAGE_LIMIT) -> str:
        text = self.model_dump_json(by_alias=True, exclude_none=True)
        if len(text.encode()) <= limit:
            return text
        if not self.ok:
            return self.model_copy(update={"error": self.error[: max(0, limit - 400)] + " …[truncated]"}) \
                .model_dump_json(by_alias=True, exclude_none=True)
        raise ValueError(f"profile report of {len(self.measurements)} setups does not fit {limit} bytes; "
                         "profile fewer setups per pod")


def parse_profile_report(text: str | None) -> ProfileReport | None:
    data = json_object(text)
    if data is None or "ok" not in data:
        return None
    try:
        return ProfileReport.model_validate(data)
    except ValidationError:
        return None

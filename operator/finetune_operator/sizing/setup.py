"""A fixed training setup: everything that decides per-GPU memory, and nothing left `auto`."""

from __future__ import annotations

from dataclasses import dataclass

from finetune_trainer.combinations import (
    ATTENTIONS,
    METHODS,
    OFFLOADS,
    OPTIMIZERS,
    PRECISIONS,
    STRATEGIES,
    Choices,
    first_violation,
)
from finetune_trainer.memory_levers import LEVERS, attention_refusal, choice_values, lever_setup_class, lever_value_checks
from finetune_trainer.optimizers import ADAMW_GROUP_MOMENT_COPIES, TRAINER_ADAMW

from .architecture import ModelArchitecture
from .errors import SizingError
from .saved_modules import saved_modules


def _padded_to(length: int, multiple: int) -> int:
    # Sequence parallelism: the collator pads each row to a multiple of the degree (data.Collator).
    return -(-length // multiple) * multiple


def declared_window(sequence_length: int, micro_batch_tokens: tuple[int, ...], count: int) -> int:
    """The most real tokens `count` consecutive samples of a run can hold (spec.dataset.microBatchTokens):
    as declared for a count the declaration covers; past it, the declared last plus the longest example
    per further sample; every example cut to sequence_length. Nothing declared: count x sequence_length."""
    longest = min(sequence_length, micro_batch_tokens[0]) if micro_batch_tokens else sequence_length
    if count <= len(micro_batch_tokens):
        return min(count * sequence_length, micro_batch_tokens[count - 1])
    known = min(len(micro_batch_tokens) * sequence_length, micro_batch_tokens[-1]) if micro_batch_tokens else 0
    return known + (count - len(micro_batch_tokens)) * longest


def _choice(field: str, value: object, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise SizingError(field, f"must be one of {', '.join(allowed)}; got {value!r}")


def _positive(field: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise SizingError(field, f"must be a positive integer, got {value!r}")


@dataclass(frozen=True)
class _SetupHead:
    """A TrainingSetup's fields before the memory levers'."""

    architecture: ModelArchitecture
    method: str = "lora"
    lora_rank: int = 16
    lora_targets: str | tuple[str, ...] = "all-linear"
    lora_dropout: float = 0.05  # the FineTuneJob API's default; > 0 saves a dropout mask per adapted input
    precision: str = "bf16"
    optimizer: str = "adamw"
    micro_batch_size: int = 1
    sequence_length: int = 2048
    gradient_checkpointing: bool = False
    attention: str = "sdpa"
    packing: bool = False  # spec.dataset.packing: examples packed with their boundaries (a mask under sdpa)
    strategy: str = "ddp"
    world_size: int = 1
    offload: str = "none"
    gradient_accumulation: int = 1


# The memory levers' fields (master_weights ... activation_offloading, as the plan status types them,
# off by default) come from the registry, after the head's (finetune_trainer/memory_levers).
_SetupLevers = lever_setup_class(_SetupHead, LEVERS)
_LEVER_CHECKS = lever_value_checks(LEVERS)


@dataclass(frozen=True)
class TrainingSetup(_SetupLevers):
    """One concrete way of training a model on `world_size` GPUs (enum spellings as in the FineTuneJob API)."""

    lora_target_experts: bool = False  # adapters on the fused 3-D expert weights too
    # peft's modules_to_save (spec.lora.modulesToSave): the family's input embedding and/or output
    # head trained in full (an fp32 copy each) beside the adapters (saved_modules.py).
    lora_modules_to_save: tuple[str, ...] = ()
    # torch AdamW's path (optimizers.ADAMW_GROUP_MOMENT_COPIES): the trainer runs fused; a published
    # setup that ran foreach (torch's choice on CUDA when none is asked for) is sized with its temporaries.
    adamw_implementation: str = TRAINER_ADAMW
    # spec.dataset.paddingFree: a micro-batch's examples laid end to end in one row (data.Collator).
    padding_free: bool = False
    # spec.dataset.microBatchTokens: the i-th (0-based) is the most tokens any i + 1 consecutive examples
    # of the run's sample order hold (the first: the longest example). Empty: any example may be
    # sequence_length long.
    micro_batch_tokens: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.architecture, ModelArchitecture):
            raise SizingError("architecture", f"must be a ModelArchitecture, got {type(self.architecture).__name__}")
        _choice("method", self.method, METHODS)
        _choice("precision", self.precision, PRECISIONS)
        _choice("optimizer", self.optimizer, OPTIMIZERS)
        _choice("attention", self.attention, ATTENTIONS)
        _choice("strategy", self.strategy, STRATEGIES)
        _choice("offload", self.offload, OFFLOADS)
        _positive("micro_batch_size", self.micro_batch_size)
        _positive("sequence_length", self.sequence_length)
        _positive("world_size", self.world_size)
        if not isinstance(self.gradient_checkpointing, bool):
            raise SizingError("gradient_checkpointing", f"must be true or false, got {self.gradient_checkpointing!r}")
        if self.method != "full":
            _positive("lora_rank", self.lora_rank)
            if not isinstance(self.lora_dropout, (int, float)) or not 0 <= self.lora_dropout < 1:
                raise SizingError("lora_dropout", f"must be in [0, 1), got {self.lora_dropout!r}")
            self.architecture.resolve_lora_targets(self.lora_targets)  # raises on unknown names
            saved_modules(self.architecture, self.lora_modules_to_save, self.lora_targets)  # raises on what is not sized
        elif self.lora_modules_to_save:
            raise SizingError("lora_modules_to_save", "method full trains every module already; modules to save "
                                                      "beside the adapters need lora or qlora")
        _positive("gradient_accumulation", self.gradient_accumulation)
        for name, check in _LEVER_CHECKS.items():  # each lever field against its declared type
            problem = check(getattr(self, name))
            if problem is not None:
                raise SizingError(name, problem)
        _choice("adamw_implementation", self.adamw_implementation, tuple(ADAMW_GROUP_MOMENT_COPIES))
        if self.adamw_implementation != TRAINER_ADAMW and (
                self.optimizer != "adamw" or (self.method == "full" and self.master_weights == "bf16")
                or self.strategy.startswith("zero")):
            raise SizingError("adamw_implementation", f"{self.adamw_implementation} is a path of torch's AdamW over "
                              "fp32 weights or adapters: it needs optimizer adamw, fp32 master weights (bf16 ones step "
                              "in the trainer's bf16 AdamW) and strategy ddp or fsdp (DeepSpeed steps its own partitions)")
        if isinstance(self.lora_modules_to_save, list):  # a list from the API: hashable, as the setup must be
            object.__setattr__(self, "lora_modules_to_save", tuple(self.lora_modules_to_save))
        if isinstance(self.micro_batch_tokens, list):
            object.__setattr__(self, "micro_batch_tokens", tuple(self.micro_batch_tokens))
        declared = self.micro_batch_tokens
        if any(not isinstance(n, int) or isinstance(n, bool) or n <= 0 for n in declared) \
                or list(declared) != sorted(declared):
            raise SizingError("micro_batch_tokens", f"must be positive token counts, non-decreasing (b + 1 examples "
                                                    f"hold at least what b do), got {declared!r}")
        if self.packing and self.padding_free:
            raise SizingError("padding_free", "packed sequences are padding-free already: set at most one of "
                                              "packing, padding_free")
        if self.sequence_parallel > 1:
            self._check_sequence_parallel()
        for name in ("packing", "padding_free", "lora_target_experts"):
            if not isinstance(getattr(self, name), bool):
                raise SizingError(name, f"must be true or false, got {getattr(self, name)!r}")
        # What combines with what: the one table the API, the trainer and the planner share.
        problem = first_violation(self.choices())
        if problem is not None:
            raise SizingError(problem.field, problem.message)

    def choices(self) -> Choices:
        """This setup's choices, as combinations.py reads them."""
        return Choices(
            method=self.method, strategy=self.strategy, offload=self.offload, optimizer=self.optimizer,
            precision=self.precision, gradient_accumulation=self.gradient_accumulation,
            gradient_checkpointing=self.gradient_checkpointing,
            target_experts=self.lora_target_experts if self.method != "full" else None,
            modules_to_save=bool(self.lora_modules_to_save) if self.method != "full" else None,
            moe=self.architecture.is_moe,
            logit_transform=bool(self.architecture.final_logit_softcapping),
            **choice_values(self),
        )

    def _check_sequence_parallel(self) -> None:
        """What Ulysses cannot split (memory_levers/sequence_parallel.py): each GPU attends over the whole
        sequence with its share of the heads, and the attention mask is dropped (causality comes from the
        position ids)."""
        arch, degree = self.architecture, self.sequence_parallel
        refusal = attention_refusal(degree, self.attention, self.packing or self.padding_free)
        if refusal is None and arch.traits.eager_only:
            refusal = f"sequence parallelism needs sdpa or flash attention; model family {arch.family} runs eager only"
        if refusal is None and arch.num_attention_heads % degree:
            refusal = (f"sequence parallelism splits the {arch.num_attention_heads} attention heads over the GPUs of a "
                       f"sequence: {degree} does not divide them")
        kv = arch.num_key_value_heads
        if refusal is None and kv % degree and degree % kv:
            refusal = f"the {kv} key/value heads and the degree {degree} must divide one another (Ulysses)"
        if refusal is None and self.attention == "sdpa" and arch.num_sliding_layers > 0:
            refusal = ("sequence parallelism drops the sliding-window mask sdpa would need: use flash attention, "
                       "which takes the window itself")
        if refusal is not None:
            raise SizingError("sequence_parallel", refusal)

    @property
    def sequence_shard(self) -> int:
        """Tokens per row on one GPU: the row, or (sequence parallelism) its slice."""
        return self.row_length // self.sequence_parallel

    @property
    def tokens_per_micro_batch(self) -> int:
        """Tokens of the micro-batch whose activations one GPU holds."""
        return self.rows * self.sequence_shard

    def window_tokens(self, count: int) -> int:
        """The most real tokens `count` consecutive examples of the run can hold (declared_window)."""
        return declared_window(self.sequence_length, self.micro_batch_tokens, count)

    @property
    def rows(self) -> int:
        """Rows of the micro-batch tensor the model sees: one when padding-free, else one per sequence."""
        return 1 if self.padding_free else self.micro_batch_size

    @property
    def row_length(self) -> int:
        """Tokens per row of the largest micro-batch the data can make. Packed: sequence_length (the
        bins fill up). Padded: the longest example (the collator pads to the micro-batch's longest).
        Padding-free: the most tokens micro_batch_size consecutive examples hold, end to end. Under
        sequence parallelism, rounded up to a multiple of the degree (the collator pads so)."""
        return _padded_to(self._real_row_length(), self.sequence_parallel)

    def _real_row_length(self) -> int:
        if self.packing:
            return self.sequence_length
        if self.padding_free:
            return self.window_tokens(self.micro_batch_size)
        return self.window_tokens(1)  # the longest example

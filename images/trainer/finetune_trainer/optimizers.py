"""The optimizers a job can train with: one `OptimizerKind` per value of `spec.training.optimizer`.

This table is the one place that says, for each optimizer, what implements it, what it keeps per
parameter and where, and what it cannot run with. Everything else reads it: the API's, the plan's
and the trainer config's enum (`NAMES`), the combination rules (`rules`), the memory model's
optimizer-state term (`OptimizerKind.state_bytes`), the recovery ladder's optimizer rung
(`OptimizerKind.counterpart`) and the trainer, which builds the optimizer from `library`.
Pure Python, no torch: the operator imports it.

The low-bit optimizers keep AdamW's two moments block-wise quantised (`Quantised`): bitsandbytes'
8-bit AdamW (CUDA only) and torchao's 8-bit and 4-bit AdamW (torchao.optim; torch tensor
subclasses, so they run wherever torch runs, the CPU included). Both libraries quantise only
tensors of at least 4096 values that are a whole number of blocks; the rest keep moments in the
parameter's own dtype. transformers' Trainer also keeps bitsandbytes' states of `nn.Embedding`
weights in 32 bits (`embeddings_full_state`), as bitsandbytes recommends; torchao has no such rule.
"""

from __future__ import annotations

from dataclasses import dataclass

from .rules import ZERO, Rule, one_of


@dataclass(frozen=True)
class Quantised:
    """Block-wise quantised moments: `bits` per value, one fp32 scale per `block` values and a
    lookup table of `code_entries` fp32 values per state tensor (bitsandbytes' and torchao's
    dynamic-tree quantisation maps)."""

    bits: int
    block: int
    code_entries: int
    min_size: int = 4096  # smaller tensors keep full-precision moments (both libraries)

    def quantises(self, numel: int) -> bool:
        return numel >= self.min_size and numel % self.block == 0

    def moment_bytes(self, numel: int) -> float:
        """Bytes of one quantised moment of a tensor of `numel` values."""
        return numel * self.bits / 8 + 4 * numel / self.block + 4 * self.code_entries

    @property
    def bytes_per_value(self) -> float:
        """One moment's bytes per value of a large tensor (the lookup table amortised away)."""
        return self.bits / 8 + 4 / self.block


@dataclass(frozen=True)
class OptimizerKind:
    name: str  # the API's value
    library: str  # what implements it: "torch", "bitsandbytes" or "torchao"
    doc: str  # one clause for the API's description
    quantised: Quantised | None = None  # None: both moments in the trained weights' dtype
    paged: bool = False  # the states live in CUDA unified memory, outside the allocator
    cuda_only: bool = False
    # transformers' Trainer keeps nn.Embedding weights' states in 32 bits (bitsandbytes only).
    embeddings_full_state: bool = False
    # Transient bytes per value of the tensor being stepped (one tensor at a time), beyond the
    # in-place update: torch's fused AdamW and bitsandbytes' kernels none; torchao's compiled
    # per-parameter step none at 8 bits and 2 at 4 bits (the unpacked codes), measured on the
    # CPU's compiled step (bench/optimizer_state.py; bench/gpu_levers.py checks it on a GPU).
    step_temp_bytes_per_value: float = 0.0
    # Rounds bf16 weights' updates stochastically when asked (bf16 master weights): the trainer's
    # bf16 AdamW for adamw, torchao's own `bf16_stochastic_round`.
    stochastic_rounding: bool = False
    # What the recovery ladder's `optimizer8bit` rung may switch to (and back).
    counterpart: str = "adamw"
    # transformers' TrainingArguments.optim, where the Trainer builds it; None: the trainer builds
    # `optimizer_class` ("module:Class") itself.
    trainer_optim: str | None = None
    optimizer_class: str | None = None

    def moment_bytes(self, numel: int, full_bytes: float) -> float:
        """Bytes of one of AdamW's two moments for a trained tensor of `numel` values whose
        full-precision moments take `full_bytes` per value (the parameter's dtype)."""
        if self.quantised is None or not self.quantised.quantises(numel):
            return numel * full_bytes
        return self.quantised.moment_bytes(numel)

    def state_bytes(self, numel: int, full_bytes: float, *, embedding: bool = False) -> float:
        """Both moments of one trained tensor (`embedding`: an nn.Embedding's weight)."""
        if embedding and self.embeddings_full_state:
            return 2 * numel * 4.0
        return 2 * self.moment_bytes(numel, full_bytes)


_BNB_8BIT = Quantised(bits=8, block=256, code_entries=256)

KINDS: tuple[OptimizerKind, ...] = (
    OptimizerKind("adamw", "torch", "`adamw` (fused torch AdamW)", counterpart="adamw-8bit", stochastic_rounding=True,
                  trainer_optim="adamw_torch_fused"),
    OptimizerKind("adamw-8bit", "bitsandbytes", "`adamw-8bit` (bitsandbytes, CUDA only)", _BNB_8BIT,
                  cuda_only=True, embeddings_full_state=True, trainer_optim="adamw_bnb_8bit"),
    OptimizerKind("paged-adamw-8bit", "bitsandbytes",
                  "`paged-adamw-8bit` (bitsandbytes; states in CUDA unified memory, CUDA only)", _BNB_8BIT,
                  paged=True, cuda_only=True, embeddings_full_state=True, trainer_optim="paged_adamw_8bit"),
    OptimizerKind("torchao-adamw-8bit", "torchao", "`torchao-adamw-8bit` (torchao's 8-bit AdamW, ddp only)",
                  Quantised(bits=8, block=256, code_entries=256), stochastic_rounding=True,
                  counterpart="torchao-adamw-4bit", optimizer_class="torchao.optim:AdamW8bit"),
    OptimizerKind("torchao-adamw-4bit", "torchao", "`torchao-adamw-4bit` (torchao's 4-bit AdamW, ddp only)",
                  Quantised(bits=4, block=128, code_entries=16), stochastic_rounding=True, step_temp_bytes_per_value=2.0,
                  optimizer_class="torchao.optim:AdamW4bit"),
)

# torch's AdamW runs one of two multi-tensor paths, which differ in what a step allocates beyond its
# in-place update, counted here in copies of one moment (the parameters' dtype) over every value of
# one parameter group (torch steps the groups one after another): `fused` (one kernel per group, in
# place) none; `foreach` takes the square root of all the group's second moments at once, one copy.
# Measured on the CPU's kernels and the dispatch tracker (bench/optimizer_state.py,
# tests/sizing/test_optimizer_state.py); bench/gpu_levers.py measures both on a GPU. The trainer asks
# for fused on every device (TrainingArguments optim adamw_torch_fused; its `optimizer` log line says
# which ran); foreach is what torch picks on CUDA when neither is asked for, as many published
# recipes ran it (a TrainingSetup sizes it when told so: adamw_implementation).
ADAMW_GROUP_MOMENT_COPIES: dict[str, int] = {"fused": 0, "foreach": 1}
TRAINER_ADAMW = "fused"

BY_NAME: dict[str, OptimizerKind] = {kind.name: kind for kind in KINDS}
NAMES: tuple[str, ...] = tuple(BY_NAME)
DEFAULT = "adamw"


def kind(name: str) -> OptimizerKind:
    return BY_NAME[name]


def of_library(library: str) -> frozenset[str]:
    return frozenset(k.name for k in KINDS if k.library == library)


BNB = of_library("bitsandbytes")
TORCHAO = of_library("torchao")

# What each optimizer cannot run with (combinations.RULES lists them).
RULES: tuple[Rule, ...] = (
    Rule("bnb-zero", {"optimizer": BNB, "strategy": ZERO}, "optimizer",
         "bitsandbytes 8-bit optimizers do not run under DeepSpeed ZeRO; use adamw (or ddp/fsdp)"),
    # DeepSpeed and FSDP hold the optimizer's parameters as flat or sharded tensors of their own and
    # save its state in their own checkpoints; torchao's quantised states are tensor subclasses that
    # this trainer has checked only on whole parameters (DDP), through torch's distributed checkpoint.
    Rule("torchao-sharded", {"optimizer": TORCHAO, "strategy": one_of("fsdp", *ZERO)}, "optimizer",
         "torchao's low-bit AdamW runs here with strategy ddp only; use adamw-8bit under fsdp"),
    Rule("torchao-kahan", {"optimizer": TORCHAO, "update_rounding": one_of("kahan")}, "update_rounding",
         "torchao's low-bit AdamW rounds bf16 weights to nearest or stochastically, not with kahan"),
)

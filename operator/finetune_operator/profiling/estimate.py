"""Sizing from a measured profile: the planner's estimator for a model the analytic model does not know.

`ProfiledArchitecture` is a ModelArchitecture whose numbers come from the profile (transformers'
config as the profile pod read it, and the parameter counts of the model it built); it carries
a `ProfiledModel`, which `sizing.estimate_memory` asks instead of the analytic model. Every
planner path (plan_job, the recovery ladder, re-planning after a lost pool) therefore sizes a
profiled model the same way without knowing it is one.

The estimate of a setup is the affine fit of setups.py, per phase, from the cached
measurements; the required bytes add the same fragmentation factor and reserves as the analytic
model (sizing/constants.py). A setup the profile did not measure and cannot extrapolate (another
method, sequence length, LoRA settings, strategy, or a lever the plain step does not have) is a
SizingError naming the field, which the planner counts as that setup not fitting.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Mapping

from finetune_trainer.contract import PROFILE_PHASES, ProfileMeasurement, ProfileReport, ProfileSetup

from finetune_trainer.memory_levers import LEVERS

from ..sizing import constants as K
from ..sizing.allocator import required_factor
from ..sizing.architecture import LinearShape, ModelArchitecture
from ..sizing.traits import FamilyTraits
from ..sizing.errors import SizingError
from ..sizing.memory import MemoryEstimate
from .setups import JobProfile

_NEUTRAL_TRAITS = FamilyTraits(False, 2, False, False, ())
# Levers of issue 13 the profile does not trace (Lever.traced_by_profile): only their plain values
# can be sized from it. The chunked loss is accepted at any chunk count: it only lowers the logits'
# peak, so the plain loss's measured figure over-estimates it (safe; the planner just gets no credit).
_PLAIN_LEVERS = {field: (off, lever.auto[field]) for lever in LEVERS if not lever.traced_by_profile
                 for field, off in lever.off.items()}


def _cell(grid: tuple[int, ...], value: int) -> tuple[int, int]:
    """The two grid points around `value` (the nearest two at either end; one point twice for a one-point grid)."""
    if len(grid) == 1:
        return grid[0], grid[0]
    for low, high in zip(grid, grid[1:]):
        if value <= high:
            return low, high
    return grid[-2], grid[-1]


def _lerp(x: float, x0: float, x1: float, f0: float, f1: float) -> float:
    return f0 if x1 == x0 else f0 + (f1 - f0) * (x - x0) / (x1 - x0)


@dataclass(frozen=True)
class ProfiledModel:
    """The measurements of one model for one job's template setup, and how to read them."""

    profile: JobProfile
    measurements: Mapping[str, ProfileMeasurement]  # by ProfileSetup.key
    config_hash: str
    architecture_params: Mapping[str, int] = field(default_factory=dict)

    def _point(self, strategy: str, gc: bool, world: int, micro: int) -> ProfileMeasurement:
        setup = self.profile.setup(strategy, gc, world, micro)
        found = self.measurements.get(setup.key)
        if found is None:
            raise SizingError("profile", f"no measurement of {setup.key} (profile the model again)")
        return found

    def phase_peaks(self, strategy: str, gc: bool, world: int, micro: int) -> dict[str, float]:
        """Bilinear in (1/W, b) inside the cell of the measured grid that holds (W, b): exact on the grid,
        never under a convex peak inside a cell (setups.py says why); linear beyond the grid's ends."""
        worlds, micros = self.profile.worlds_of(strategy), self.profile.micro_batches
        w0, w1 = _cell(worlds, world)
        b0, b1 = _cell(micros, micro)
        x = 1.0 / world if len(worlds) > 1 else 1.0 / w0
        out = {}
        corners = {(w, b): self._point(strategy, gc, w, b).peaks for w in (w0, w1) for b in (b0, b1)}
        for ph in PROFILE_PHASES:
            at_b0 = _lerp(x, 1.0 / w0, 1.0 / w1, corners[w0, b0][ph], corners[w1, b0][ph])
            at_b1 = _lerp(x, 1.0 / w0, 1.0 / w1, corners[w0, b1][ph], corners[w1, b1][ph])
            out[ph] = _lerp(micro, b0, b1, at_b0, at_b1)
        return out

    def check(self, setup: Any) -> None:
        t = self.profile.template
        wanted = {
            "method": (setup.method, t.method), "precision": (setup.precision, t.precision),
            "sequence_length": (setup.sequence_length, t.sequence_length),
            "optimizer": (setup.optimizer, "adamw"), "offload": (setup.offload, "none"),
            "packing": (getattr(setup, "packing", False), t.packing),
            # The profile traces padded rows without a mask; a padding-free row's mask is not in it.
            "padding_free": (getattr(setup, "padding_free", False), False),
        }
        for name, (got, measured) in wanted.items():
            if got != measured:
                raise SizingError(name, f"the profile measured {measured!r}, not {got!r}")
        if setup.strategy not in self.profile.strategies:
            raise SizingError("strategy", f"the profile measured {', '.join(self.profile.strategies)}, "
                              f"not {setup.strategy} (DeepSpeed cannot be traced)")
        if setup.gradient_checkpointing not in self.profile.checkpointing:
            raise SizingError("gradient_checkpointing", "the profile did not measure this checkpointing setting")
        if ("eager" if setup.attention == "eager" else "sdpa") != t.attention:
            raise SizingError("attention", f"the profile measured {t.attention}, not {setup.attention}")
        if setup.method != "full":
            targets = "all-linear" if setup.lora_targets == "all-linear" else list(setup.lora_targets)
            if (setup.lora_rank, float(setup.lora_dropout), targets, list(setup.lora_modules_to_save)) != (
                    t.lora_rank, float(t.lora_dropout), t.lora_targets, t.lora_modules_to_save or []):
                raise SizingError("lora", "the profile measured other LoRA settings")
        for name, plain in _PLAIN_LEVERS.items():
            if hasattr(setup, name) and getattr(setup, name) not in plain:
                raise SizingError(name, f"{getattr(setup, name)!r} is not traced by the profile (plain step only)")

    def trainable_params(self) -> int:
        return max((m.trainable_params for m in self.measurements.values()), default=0)

    def estimate(self, setup: Any) -> MemoryEstimate:
        self.check(setup)
        n, b = setup.world_size, setup.micro_batch_size
        peaks = self.phase_peaks(setup.strategy, setup.gradient_checkpointing, n, b)
        buckets = 0
        if setup.strategy == "ddp" and n > 1:
            buckets = max(m.ddp_bucket_bytes for m in self.measurements.values())
        totals = {ph: int(math.ceil(v)) + buckets for ph, v in peaks.items()}
        peak_phase = max(PROFILE_PHASES, key=lambda ph: totals[ph])
        peak = totals[peak_phase]
        breakdown = {"measured": peak - buckets, "buffers": buckets}
        reserve = K.CUDA_CONTEXT_RESERVE_BYTES + (K.NCCL_RESERVE_BYTES if n > 1 else 0)
        factor = required_factor(setup)
        return MemoryEstimate(
            peak_allocated_bytes=peak,
            required_bytes=int(math.ceil(peak * factor)) + reserve, fragmentation_factor=factor,
            peak_phase=peak_phase, breakdown=breakdown,
            host_required_bytes=self._host_bytes(setup),
            notes=(f"measured by the pre-flight profile (config {self.config_hash}; "
                   f"{setup.strategy} interpolated between traced corners of GPUs and micro-batch)",),
            phase_peaks=totals, reserve_bytes=reserve,
        )

    def _host_bytes(self, setup: Any) -> int:
        total = self.architecture_params["total"]
        load_b = 4 if (setup.method == "full" or setup.precision == "fp32") else 2
        loading = load_b * total / setup.world_size + K.HOST_SHARD_BYTES if setup.strategy == "fsdp" \
            else load_b * total
        return int(K.HOST_PROCESS_BYTES + K.HOST_DATALOADER_BYTES + loading)


@dataclass(frozen=True)
class ProfiledArchitecture(ModelArchitecture):
    """A ModelArchitecture of a family only the profile knows; sizing asks `profiled` for estimates."""

    config_hash: str = ""
    total: int = 0
    embedding: int = 0
    lm_head: int = 0
    profiled: ProfiledModel | None = field(default=None, compare=False, hash=False, repr=False)

    def __post_init__(self) -> None:  # the family check of the analytic model does not apply
        if self.profiled is None or self.total <= 0:
            raise SizingError("profile", "a profiled architecture needs its measurements")

    @property
    def traits(self) -> FamilyTraits:
        return _NEUTRAL_TRAITS

    @property
    def is_moe(self) -> bool:
        return False  # the throughput model counts every parameter as active: conservative for MoE

    def block_linears(self) -> tuple[LinearShape, ...]:
        return ()

    @cached_property
    def _params_by_kind(self) -> dict[str, int]:
        rest = self.total - self.embedding - self.lm_head
        return {"embedding": self.embedding, "attention": 0, "mlp": rest, "router": 0, "norm": 0,
                "lm_head": self.lm_head, "vision": 0}

    @property
    def active_params(self) -> int:
        return self.total  # every parameter counted as active: conservative for mixture-of-experts models

    @property
    def expert_params(self) -> int:
        return 0

    @property
    def total_params(self) -> int:
        return self.total

    @property
    def linear_params(self) -> int:
        return self.total - self.embedding - self.lm_head

    @property
    def block_params(self) -> int:
        return max(1, (self.total - self.embedding - self.lm_head) // self.num_layers)

    def resolve_lora_targets(self, targets) -> tuple[LinearShape, ...]:
        return ()  # peft resolves them in the profile pod (an unknown name fails the profile)

    def lora_trainable_params(self, rank: int, targets="all-linear") -> int:
        return self.profiled.trainable_params()


def profiled_architecture(report: ProfileReport, profile: JobProfile, measurements: Mapping[str, ProfileMeasurement],
                          config_hash: str, name: str = "") -> ProfiledArchitecture:
    """The architecture the planner plans a profiled model with."""
    shape = report.shape
    if shape is None:
        raise SizingError("profile", "the profile reported no model shape")
    params = dict(report.params)
    model = ProfiledModel(profile, dict(measurements), config_hash, architecture_params=params)
    return ProfiledArchitecture(
        family=shape.model_type, vocab_size=shape.vocab_size, hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size, num_layers=shape.num_layers,
        num_attention_heads=shape.num_attention_heads, num_key_value_heads=shape.num_key_value_heads,
        head_dim=shape.head_dim, tie_word_embeddings=shape.tie_word_embeddings, name=name,
        config_hash=config_hash, total=params.get("total", 0), embedding=params.get("embedding", 0),
        lm_head=params.get("lmHead", 0), profiled=model,
    )

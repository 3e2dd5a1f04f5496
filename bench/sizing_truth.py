"""Measured truth for the sizing estimator: peak allocated bytes of real training steps,
traced on the CPU with PyTorch fake tensors (no weights are allocated, so 8B and 70B
configs run on a laptop). The tracing code is the pre-flight profile's
(images/trainer/finetune_trainer/profile.py): the truth and the profile share it.

What runs is what our trainer runs (see notes/trainer_settings.md):
* full fine-tuning: fp32 weights, forward under bf16 autocast (exited at the end of the
  forward, as accelerate wraps `model.forward`) and the model outputs converted to fp32
  (accelerate's `convert_outputs_to_fp32`); fused AdamW; FSDP2 `fully_shard` per
  decoder block and at the root, param_dtype bf16, reduce_dtype fp32;
* LoRA: base in bf16, frozen; peft adapters in fp32 (peft's default), dropout as set;
* transformers' causal-LM loss (logits upcast to fp32), only the loss is kept;
* gradient clipping at 1.0 (the Trainer's default), then `optimizer.step()` and
  `zero_grad(set_to_none=True)`;
* non-reentrant gradient checkpointing.

What differs on the CPU is emulated: the CUDA caching allocator's 512-byte rounding
(in the tracker), dropout (the fused CUDA kernel keeps a bool mask), and sdpa/flash attention, which calls the CUDA flash kernel's meta
function (bf16, no mask) instead of the CPU kernel. Two steps run; the second one's
peak is reported (AdamW's state exists only after the first `step()`).

Usage: python bench/sizing_truth.py --preset llama-3.2-1b --method lora --seq 2048 [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict, dataclass, field

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "operator"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "images", "trainer"))

from finetune_operator.sizing import PRESETS, ModelArchitecture, TrainingSetup  # noqa: E402

SUPPORTED = dict(method=("full", "lora"), precision=("bf16",), optimizer=("adamw",), strategy=("ddp", "fsdp"), offload=("none",))


@dataclass
class Measurement:
    peak_bytes: int  # peak of the reported (last) step
    phase_peaks: dict[str, int]  # forward / backward / optimizer peaks of that step
    first_step_peak: int
    wall_s: float
    notes: list[str] = field(default_factory=list)


def check_supported(setup: TrainingSetup) -> None:
    for name, allowed in SUPPORTED.items():
        if getattr(setup, name) not in allowed:
            raise ValueError(f"the fake-tensor truth cannot trace {name}={getattr(setup, name)!r} (only {allowed})")


def profile_setup(setup: TrainingSetup):
    """The setup as the shared profile code (finetune_trainer.profile) takes it."""
    from finetune_trainer.contract import ProfileSetup

    targets = setup.lora_targets if isinstance(setup.lora_targets, str) else list(setup.lora_targets)
    return ProfileSetup(
        method=setup.method, lora_rank=setup.lora_rank, lora_alpha=2 * setup.lora_rank,
        lora_dropout=setup.lora_dropout, lora_targets=targets, precision=setup.precision,
        # A family transformers cannot run with sdpa (gpt-oss: attention sinks) runs eager, as in the trainer.
        attention="eager" if setup.attention == "eager" or setup.architecture.traits.eager_only else "sdpa",
        sequence_length=setup.sequence_length,
        micro_batch_size=setup.micro_batch_size, gradient_checkpointing=setup.gradient_checkpointing,
        strategy=setup.strategy, world_size=setup.world_size,
    )


def measure(setup: TrainingSetup, steps: int = 2) -> Measurement:
    """Trace `setup` with the pre-flight profile's code (the model built from the architecture's config.json)."""
    from finetune_trainer import profile

    check_supported(setup)
    m = profile.measure(setup.architecture.to_hf_config(), profile_setup(setup), steps=steps)
    return Measurement(peak_bytes=m.peak_bytes, phase_peaks=m.phase_peaks, first_step_peak=m.first_step_peak,
                       wall_s=m.wall_s, notes=m.notes)


def setup_from_args(ns) -> TrainingSetup:
    arch = ModelArchitecture.from_preset(ns.preset)
    if ns.layers:
        arch = arch.with_layers(ns.layers)
    return TrainingSetup(
        architecture=arch, method=ns.method, lora_rank=ns.rank, lora_dropout=ns.dropout, micro_batch_size=ns.batch,
        sequence_length=ns.seq, gradient_checkpointing=ns.gc, attention=ns.attention,
        strategy=ns.strategy, world_size=ns.world_size,
    )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="llama-3.2-1b", choices=sorted(PRESETS))
    p.add_argument("--layers", type=int, default=0, help="cut the model to this many blocks")
    p.add_argument("--method", default="lora", choices=("full", "lora"))
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--dropout", type=float, default=0.0, help="LoRA dropout")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--gc", action="store_true")
    p.add_argument("--attention", default="sdpa", choices=("sdpa", "flash", "eager"))
    p.add_argument("--strategy", default="ddp", choices=("ddp", "fsdp"))
    p.add_argument("--world-size", type=int, default=1)
    p.add_argument("--json", action="store_true")
    ns = p.parse_args(argv)
    m = measure(setup_from_args(ns))
    if ns.json:
        print(json.dumps(asdict(m)))
    else:
        gib = 1 << 30
        print(f"peak {m.peak_bytes / gib:.3f} GiB (first step {m.first_step_peak / gib:.3f}); "
              + ", ".join(f"{k} {v / gib:.3f}" for k, v in m.phase_peaks.items()) + f"; {m.wall_s:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

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
function (bf16, no mask) instead of the CPU kernel; layer_norm and pow run in fp32 under autocast, as CUDA's autocast runs them. Two steps run; the second one's
peak is reported (AdamW's state exists only after the first `step()`).

Usage: python bench/sizing_truth.py --preset llama-3.2-1b --method lora --seq 2048 [--json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "operator"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "images", "trainer"))

from finetune_operator.sizing import PRESETS, ModelArchitecture, TrainingSetup  # noqa: E402
from finetune_operator.sizing.presets import preset  # noqa: E402

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
        lora_modules_to_save=list(setup.lora_modules_to_save) or None,
        # A family transformers cannot run with sdpa (gpt-oss: attention sinks) runs eager, as in the trainer.
        attention="eager" if setup.attention == "eager" or setup.architecture.traits.eager_only else "sdpa",
        # The tensor the model sees: padded to the longest example, or (padding-free) the micro-batch's
        # examples in one row with restarting positions, which under sdpa and eager gives the packed
        # sequences' block-diagonal mask (flash is traced as sdpa without a mask: its kernel needs none).
        sequence_length=setup.row_length,
        packing=(setup.packing or setup.padding_free) and setup.attention != "flash",
        micro_batch_size=setup.rows, gradient_checkpointing=setup.gradient_checkpointing,
        strategy=setup.strategy, world_size=setup.world_size,
    )


def measure(setup: TrainingSetup, steps: int = 2) -> Measurement:
    """Trace `setup` with the pre-flight profile's code (the model built from the architecture's config.json)."""
    from finetune_trainer import profile

    check_supported(setup)
    m = profile.measure(setup.architecture.to_hf_config(), profile_setup(setup), steps=steps)
    return Measurement(peak_bytes=m.peak_bytes, phase_peaks=m.phase_peaks, first_step_peak=m.first_step_peak,
                       wall_s=m.wall_s, notes=m.notes)


_PEAKS: dict = {}


def peak_bytes(setup: TrainingSetup) -> int:
    """`measure(setup)`'s peak, traced once per setup in this process (tests compare a setup with
    a deeper or plainer one, and meet the same setup again)."""
    if setup not in _PEAKS:
        _PEAKS[setup] = measure(setup).peak_bytes
    return _PEAKS[setup]


# ---- the lean-trainer levers, through the trainer's own lever code ------------------------

LEVER_SUPPORTED = dict(method=("full", "lora"), precision=("bf16",), optimizer=("adamw",), strategy=("ddp",),
                       world_size=(1,), offload=("none",))


def has_levers(setup: TrainingSetup) -> bool:
    return (setup.master_weights != "fp32" or setup.optimizer_in_backward or setup.loss_chunks > 1
            or setup.activation_offloading or setup.adamw_implementation != "fused")


def measure_levers(setup: TrainingSetup, steps: int = 2) -> Measurement:
    """Trace `setup` with the trainer's lever code on fake tensors: its bf16 AdamW
    (bf16_adamw.BF16AdamW, with the update rounding), the optimizer step in backward
    (optimizer_in_backward.InBackwardOptimizer: one optimizer per parameter, stepped from its
    post-accumulate-grad hook), torch's foreach AdamW in place of the fused one when the setup
    says so (a published setup's), the chunked loss (chunked_loss.ChunkedLoss on the output
    projection) and activation offloading (activation_offload.install on the checkpointed
    layers). One GPU (the levers' multi-rank behaviour is not traced here).

    Activation offloading's host copies are made on the meta device, which the tracker does
    not count: they stand for host memory; the copy back in backward is counted (it is on the GPU).
    """
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from finetune_trainer import activation_offload, profile
    from finetune_trainer.bf16_adamw import BF16AdamW
    from finetune_trainer.chunked_loss import ChunkedLoss
    from finetune_trainer.optimizer_in_backward import InBackwardOptimizer
    from finetune_trainer.peak_tracker import PeakTracker

    for name, allowed in LEVER_SUPPORTED.items():
        if getattr(setup, name) not in allowed:
            raise ValueError(f"the lever truth cannot trace {name}={getattr(setup, name)!r} (only {allowed})")
    t0 = time.perf_counter()
    notes: list[str] = []
    master_bf16 = setup.method == "full" and setup.master_weights == "bf16"
    model = profile.build_meta_model(profile.hf_config(setup.architecture.to_hf_config()), profile_setup(setup))
    if master_bf16:
        model.to(torch.bfloat16)  # the trainer loads the model in bf16: no fp32 copy, no autocast
    stats = None
    if setup.activation_offloading:
        original = activation_offload._Offloader

        class HostAsMeta(original):  # the host copy, uncounted; the copy back, counted
            def pack(self, tensor):
                size = tensor.numel() * tensor.element_size()
                self.stats.tensors += 1
                self.stats.bytes += size
                return (tensor.device, torch.empty(tensor.size(), dtype=tensor.dtype, device="meta"), size)

            def unpack(self, packed):
                if isinstance(packed, torch.Tensor):
                    return packed
                device, host, _ = packed
                return torch.empty(host.size(), dtype=host.dtype, device=device)

        activation_offload._Offloader = HostAsMeta
        try:
            stats = activation_offload.install(model)
        finally:
            activation_offload._Offloader = original
    chunked = ChunkedLoss(model, setup.loss_chunks) if setup.loss_chunks > 1 else None
    shared = profile.shared_parameters(model)  # tied embeddings, re-tied after to_empty
    tracker = PeakTracker()
    step_peaks: list[tuple[int, dict]] = []
    # The bf16 AdamW reads its step count as a Python float (bias correction): a fake tensor has
    # no value, and the value does not change what is allocated.
    from finetune_trainer import bf16_adamw

    bf16_adamw.float = lambda value: 1.0 if isinstance(value, torch.Tensor) else float(value)
    with contextlib.ExitStack() as restore:
        restore.callback(lambda: delattr(bf16_adamw, "float"))
        return _trace_levers(setup, model, chunked, stats, master_bf16, tracker, step_peaks, shared, steps, t0, notes,
                             BF16AdamW, InBackwardOptimizer, FakeTensorMode, profile)


def _trace_levers(setup, model, chunked, stats, master_bf16, tracker, step_peaks, shared, steps, t0, notes,
                  BF16AdamW, InBackwardOptimizer, FakeTensorMode, profile) -> Measurement:
    import torch

    b, s = setup.micro_batch_size, setup.sequence_length
    with profile._patched_transformers(), FakeTensorMode(allow_non_fake_inputs=True), tracker:
        model.to_empty(device="cpu")
        profile.retie(shared)
        named = [(n, p, 0.0) for n, p in model.named_parameters() if p.requires_grad]
        params = [p for _, p, _ in named]

        def make(groups):
            if master_bf16:
                return BF16AdamW(groups, lr=1e-4, rounding=setup.update_rounding)
            path = {"fused": True} if setup.adamw_implementation == "fused" else {"foreach": True}
            return torch.optim.AdamW(groups, lr=1e-4, **path)

        optimizer = InBackwardOptimizer(named, make) if setup.optimizer_in_backward else make(params)
        forward = model.__call__ if master_bf16 else profile._wrap_forward_like_accelerate(model, setup.precision)
        input_ids = torch.zeros((b, s), dtype=torch.long)
        labels = torch.zeros((b, s), dtype=torch.long)
        for _ in range(steps):
            tracker.reset_peak()
            tracker.mark("forward")
            if chunked is not None:
                loss = chunked.loss(forward, {"input_ids": input_ids, "labels": labels})
            else:
                loss = forward(input_ids=input_ids, labels=labels).loss
            tracker.mark("backward")
            loss.backward()
            del loss
            tracker.mark("optimizer")
            if not setup.optimizer_in_backward:  # the step in backward cannot clip by global norm
                torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step_peaks.append((tracker.peak, dict(tracker.phase_peaks)))
        del input_ids, labels
    if stats is not None:
        notes.append(f"activation offloading moved {stats.tensors // steps} tensors, "
                     f"{stats.bytes / steps / (1 << 30):.3f} GiB per step to the host")
    peak, phases = step_peaks[-1]
    return Measurement(peak_bytes=peak, phase_peaks=phases, first_step_peak=step_peaks[0][0],
                       wall_s=time.perf_counter() - t0, notes=notes)


def setup_from_args(ns) -> TrainingSetup:
    arch = preset(ns.preset)
    if ns.layers:
        arch = arch.with_layers(ns.layers)
    targets = "all-linear" if ns.targets == "all-linear" else tuple(ns.targets.split(","))
    return TrainingSetup(
        architecture=arch, method=ns.method, lora_rank=ns.rank, lora_dropout=ns.dropout, lora_targets=targets,
        lora_modules_to_save=tuple(m for m in ns.modules_to_save.split(",") if m), micro_batch_size=ns.batch,
        sequence_length=ns.seq, gradient_checkpointing=ns.gc, attention=ns.attention,
        packing=ns.packing, strategy=ns.strategy, world_size=ns.world_size, master_weights=ns.master_weights,
        update_rounding=ns.rounding, optimizer_in_backward=ns.optimizer_in_backward, loss_chunks=ns.loss_chunks,
        activation_offloading=ns.activation_offloading, adamw_implementation=ns.adamw_implementation,
        gradient_accumulation=1,
    )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="llama-3.2-1b", choices=sorted(PRESETS))
    p.add_argument("--layers", type=int, default=0, help="cut the model to this many blocks")
    p.add_argument("--method", default="lora", choices=("full", "lora"))
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--dropout", type=float, default=0.0, help="LoRA dropout")
    p.add_argument("--targets", default="all-linear", help="LoRA target modules, comma-separated, or all-linear")
    p.add_argument("--modules-to-save", default="", help="lora.modulesToSave, comma-separated")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--gc", action="store_true")
    p.add_argument("--attention", default="sdpa", choices=("sdpa", "flash", "eager"))
    p.add_argument("--packing", action="store_true", help="examples packed with their boundaries")
    p.add_argument("--strategy", default="ddp", choices=("ddp", "fsdp"))
    p.add_argument("--world-size", type=int, default=1)
    p.add_argument("--master-weights", default="fp32", choices=("fp32", "bf16"))
    p.add_argument("--rounding", default="nearest", choices=("nearest", "stochastic", "kahan"))
    p.add_argument("--optimizer-in-backward", action="store_true")
    p.add_argument("--loss-chunks", type=int, default=1)
    p.add_argument("--activation-offloading", action="store_true")
    p.add_argument("--adamw-implementation", default="fused", choices=("fused", "foreach"))
    p.add_argument("--json", action="store_true")
    ns = p.parse_args(argv)
    setup = setup_from_args(ns)
    m = measure_levers(setup) if has_levers(setup) else measure(setup)
    if ns.json:
        print(json.dumps(asdict(m)))
    else:
        gib = 1 << 30
        print(f"peak {m.peak_bytes / gib:.3f} GiB (first step {m.first_step_peak / gib:.3f}); "
              + ", ".join(f"{k} {v / gib:.3f}" for k, v in m.phase_peaks.items()) + f"; {m.wall_s:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

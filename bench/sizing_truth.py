"""Measured truth for the sizing estimator: peak allocated bytes of real training steps,
traced on the CPU with PyTorch fake tensors (no weights are allocated, so 8B and 70B
configs run on a laptop).

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
import contextlib
import json
import os
import sys
import time
import warnings
from dataclasses import asdict, dataclass, field

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "operator"))

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


def _flash_sdpa(orig):
    """sdpa as the CUDA flash kernel would run it: no s x s scores, an fp32 logsumexp per row."""
    import torch

    def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if torch.is_autocast_enabled("cpu") and query.dtype == torch.float32:
            # CUDA autocast runs sdpa in the lower precision; calling the kernel directly skips it.
            low = torch.get_autocast_dtype("cpu")
            query, key, value = query.to(low), key.to(low), value.to(low)
        if attn_mask is None and query.dtype in (torch.bfloat16, torch.float16):
            out = torch.ops.aten._scaled_dot_product_flash_attention(
                query, key, value, dropout_p, is_causal, False, scale=scale
            )
            return out[0]
        return orig(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                    scale=scale, enable_gqa=enable_gqa)

    return sdpa


@contextlib.contextmanager
def _patched_transformers():
    """Make transformers behave as in a real, unpacked training batch."""
    import torch
    import transformers.masking_utils as mu
    import transformers.integrations.sdpa_attention as sa

    orig_packed = mu.find_packed_sequence_indices
    # Under fake tensors transformers cannot read position_ids and assumes packing,
    # which builds a dense 4-D mask a real batch never has.
    mu.find_packed_sequence_indices = lambda position_ids: None
    orig_sdpa = torch.nn.functional.scaled_dot_product_attention
    sa.torch.nn.functional.scaled_dot_product_attention = _flash_sdpa(orig_sdpa)
    # CUDA runs dropout as one fused kernel that saves a bool mask; the CPU composite
    # saves a float noise tensor of the input's dtype. Run the fused op, as on a GPU.
    orig_dropout = torch.nn.functional.dropout

    def dropout(input, p=0.5, training=True, inplace=False):
        if training and 0.0 < p < 1.0 and not inplace:
            return torch.native_dropout(input, p, True)[0]
        return orig_dropout(input, p, training, inplace)

    torch.nn.functional.dropout = dropout
    try:
        yield
    finally:
        mu.find_packed_sequence_indices = orig_packed
        sa.torch.nn.functional.scaled_dot_product_attention = orig_sdpa
        torch.nn.functional.dropout = orig_dropout


def _init_fake_world(world_size: int):
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        if dist.get_world_size() == world_size:
            return
        dist.destroy_process_group()
    dist.init_process_group("fake", rank=0, world_size=world_size, store=FakeStore())


def _build_meta_model(setup: TrainingSetup):
    import torch
    import transformers

    arch = setup.architecture
    attn = {"sdpa": "sdpa", "flash": "sdpa", "eager": "eager"}[setup.attention]
    config = transformers.AutoConfig.for_model(**arch.to_hf_config())
    config.use_cache = False
    dtype = torch.float32 if setup.method == "full" else torch.bfloat16
    with warnings.catch_warnings(), torch.device("meta"):
        warnings.simplefilter("ignore")
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=dtype)
    if setup.method != "full":
        import peft

        targets = setup.lora_targets if setup.lora_targets == "all-linear" else list(setup.lora_targets)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = peft.get_peft_model(model, peft.LoraConfig(r=setup.lora_rank, lora_alpha=2 * setup.lora_rank,
                                                               lora_dropout=setup.lora_dropout,
                                                               target_modules=targets))
    if setup.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    return model


def _apply_fsdp_like_transformers(model, mesh) -> None:
    """FSDP2 as transformers applies it at load time (DistributedConfig, the model's default plan).

    The plan is {embed_tokens, layers.*: free_full_weight; norm, lm_head: keep_full_weight}:
    the embeddings and every block are their own groups, resharded after forward; the final
    norm and the head form one group kept gathered from forward to backward (with tied
    embeddings the embedding takes the head's place); then the root. Mixed precision:
    param_dtype bf16, reduce_dtype fp32.
    """
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, output_dtype=None)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    tied = base.config.tie_word_embeddings
    if not tied:
        fully_shard(base.model.embed_tokens, mesh=mesh, reshard_after_forward=True, mp_policy=mp)
    for layer in base.model.layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=True, mp_policy=mp)
    tail = [base.model.norm, base.model.embed_tokens, base.lm_head] if tied else [base.model.norm, base.lm_head]
    fully_shard(tail, mesh=mesh, reshard_after_forward=False, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)


def _decoder_layers(model):
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return base.model.layers


def _wrap_forward_like_accelerate(model, precision: str):
    """Autocast around the forward and fp32 outputs, as accelerate.prepare does for mixed precision."""
    import torch
    from accelerate.utils import convert_outputs_to_fp32

    if precision == "fp32":
        return model.__call__
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    forward = model.__call__

    def autocast_forward(*args, **kwargs):
        with torch.autocast("cpu", dtype=dtype):
            return forward(*args, **kwargs)

    return convert_outputs_to_fp32(autocast_forward)


def _ddp_reducer_buckets(params, first_cap=1 << 20, cap=25 << 20):
    """Allocate what DDP's C++ Reducer allocates at construction (it runs outside the fake dispatcher).

    With gradient_as_bucket_view=False (accelerate's default) the Reducer keeps one flat
    tensor per bucket, in the gradient dtype, holding a copy of every trainable gradient:
    buckets of 1 MiB first, then 25 MiB, filled in reverse parameter order. The all-reduce
    itself runs in place on the fake process group.
    """
    import torch

    buckets, size, limit, dtype = [], 0, first_cap, None
    members = []
    for p in reversed(params):
        nbytes = p.numel() * p.element_size()
        if members and (size + nbytes > limit or p.dtype != dtype):
            buckets.append(torch.empty(sum(m.numel() for m in members), dtype=dtype))
            members, size, limit = [], 0, cap
        members.append(p)
        size += nbytes
        dtype = p.dtype
    if members:
        buckets.append(torch.empty(sum(m.numel() for m in members), dtype=dtype))
    return buckets


def measure(setup: TrainingSetup, steps: int = 2) -> Measurement:
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    check_supported(setup)
    from peak_tracker import PeakTracker

    t0 = time.perf_counter()
    notes: list[str] = []
    sharded = setup.strategy == "fsdp"
    distributed = setup.world_size > 1 or sharded
    mesh = None
    if distributed:
        _init_fake_world(setup.world_size)
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (setup.world_size,))  # before the fake mode (see module doc)

    model = _build_meta_model(setup)
    if sharded:
        _apply_fsdp_like_transformers(model, mesh)

    b, s = setup.micro_batch_size, setup.sequence_length
    vocab = setup.architecture.vocab_size
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    # DTensor sharding propagation would otherwise build its global-shape tensors in our mode.
    import torch.distributed.tensor._sharding_prop as sharding_prop

    own_mode = FakeTensorMode(allow_non_fake_inputs=True)
    orig_detect = sharding_prop.detect_fake_mode
    sharding_prop.detect_fake_mode = lambda *a: own_mode
    tracker = PeakTracker()
    step_peaks: list[tuple[int, dict]] = []
    try:
        with _patched_transformers(), fake_mode, tracker:
            model.to_empty(device="cpu")
            if not sharded and setup.architecture.tie_word_embeddings:
                model.tie_weights()
            params = [p for p in model.parameters() if p.requires_grad]
            ddp_buckets = _ddp_reducer_buckets(params) if distributed and not sharded else []
            optimizer = torch.optim.AdamW(params, lr=1e-4, fused=True)
            forward = _wrap_forward_like_accelerate(model, setup.precision)
            input_ids = torch.zeros((b, s), dtype=torch.long)
            labels = torch.zeros((b, s), dtype=torch.long)
            for _ in range(steps):
                tracker.reset_peak()
                tracker.mark("forward")
                loss = forward(input_ids=input_ids, labels=labels).loss  # the output is dropped here
                tracker.mark("backward")
                loss.backward()
                del loss
                tracker.mark("optimizer")
                torch.nn.utils.clip_grad_norm_(params, 1.0)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                step_peaks.append((tracker.peak, dict(tracker.phase_peaks)))
            del input_ids, labels, ddp_buckets
    finally:
        sharding_prop.detect_fake_mode = orig_detect
        if distributed:
            # Leave no process group behind: callers in the same process (tests) must not
            # inherit a fake world.
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
    del vocab
    peak, phases = step_peaks[-1]
    return Measurement(peak_bytes=peak, phase_peaks=phases, first_step_peak=step_peaks[0][0],
                       wall_s=time.perf_counter() - t0, notes=notes)


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

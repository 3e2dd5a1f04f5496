"""The pre-flight memory profile: peak allocated bytes of the trainer's training step, traced on
the CPU with PyTorch fake tensors (no weights are allocated, so an 8B model profiles on a laptop).

The operator runs this in a CPU-only pod (`python -m finetune_trainer.profile`) for a model whose
family its analytic memory model does not know, and plans with what it reports;
bench/sizing_truth.py measures the analytic model's truth with the same code.

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
(in the tracker), dropout (the fused CUDA kernel keeps a bool mask), sdpa/flash attention,
which calls the CUDA flash kernel's meta function (bf16, no mask) instead of the CPU kernel,
and CUDA autocast's fp32 layer_norm and pow (CPU autocast leaves them in bf16); CUDA's other
fp32-list ops (softmax, exp, ...) are not emulated.
Two steps run; the second one's peak is reported (AdamW's state exists only after the first
`step()`). DDP's reducer buckets (C++, outside the dispatcher) are allocated as the reducer does.

The model is any transformers causal LM: built from the job's config.json with
`AutoModelForCausalLM.from_config` on the meta device; with `trust_remote_code` (only when the job
allows it) its code is imported from the model's own directory, never from the network
(HF_HUB_OFFLINE is forced). FSDP groups follow transformers' plan generically: the blocks are the
model's `_no_split_modules`, the input embedding is its own group, the head and every other
parameter-holding module (the final norm) one group kept gathered, then the root.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Mapping

from .contract import (
    DEFAULT_REPORT_PATH,
    EXIT_CONFIG_ERROR,
    EXIT_OK,
    PROFILE_PHASES,
    PROFILE_REQUEST_ENV,
    ProfileMeasurement,
    ProfileReport,
    ProfileRequest,
    ProfileSetup,
    ProfileShape,
)


class ProfileError(Exception):
    """The model cannot be built or traced: `field` is the job field to blame ("" when none)."""

    def __init__(self, message: str, field: str = ""):
        super().__init__(message)
        self.field = field


@dataclass
class Measurement:
    peak_bytes: int  # peak of the reported (last) step
    phase_peaks: dict[str, int]  # forward / backward / optimizer peaks of that step
    first_step_peak: int
    wall_s: float
    trainable_params: int = 0
    ddp_bucket_bytes: int = 0  # the reducer's buckets (allocated only on more than one rank)
    notes: list[str] = field(default_factory=list)


# ---------------------------------------------------------------------------
# emulating CUDA on the CPU
# ---------------------------------------------------------------------------


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
def _patched_transformers(packed: bool = False):
    """Make transformers behave as in a real training batch, unpacked or `packed`."""
    import torch
    import transformers.integrations.sdpa_attention as sa
    import transformers.masking_utils as mu

    orig_packed = mu.find_packed_sequence_indices
    if not packed:
        # Under fake tensors transformers cannot read position_ids and assumes packing,
        # which builds a dense 4-D mask an unpacked batch never has (a packed one does).
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
    # CUDA's autocast runs layer_norm and pow in fp32 (its fp32 op list); CPU's autocast leaves
    # them in bf16. LayerNorm families (phi, gpt_neox) and gelu_new's pow save fp32 tensors on a
    # GPU: run them as CUDA autocast would.
    orig_layer_norm, orig_pow = torch.nn.functional.layer_norm, torch.pow
    torch.nn.functional.layer_norm = _fp32_under_autocast(orig_layer_norm)
    torch.pow = _fp32_under_autocast(orig_pow)
    try:
        yield
    finally:
        mu.find_packed_sequence_indices = orig_packed
        sa.torch.nn.functional.scaled_dot_product_attention = orig_sdpa
        torch.nn.functional.dropout = orig_dropout
        torch.nn.functional.layer_norm, torch.pow = orig_layer_norm, orig_pow


def _fp32_under_autocast(op):
    """`op` as CUDA autocast runs an op of its fp32 list: low-precision floating inputs cast to
    fp32, the op run in fp32 (its output, and what it saves, fp32)."""
    import torch

    def widen(value):
        if isinstance(value, torch.Tensor) and value.dtype in (torch.bfloat16, torch.float16):
            return value.float()
        return value

    def run(*args, **kwargs):
        if not (torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") in (torch.bfloat16, torch.float16)):
            return op(*args, **kwargs)
        with torch.autocast("cpu", enabled=False):
            return op(*[widen(a) for a in args], **{k: widen(v) for k, v in kwargs.items()})

    return run


def _init_fake_world(world_size: int):
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        if dist.get_world_size() == world_size:
            return
        dist.destroy_process_group()
    dist.init_process_group("fake", rank=0, world_size=world_size, store=FakeStore())


# ---------------------------------------------------------------------------
# the model
# ---------------------------------------------------------------------------


def hf_config(config: Mapping[str, Any] | Any, *, model_path: str | None = None, trust_remote_code: bool = False):
    """transformers' config object for a config.json dict (or a config object, returned as is)."""
    os.environ["HF_HUB_OFFLINE"] = "1"  # never the network, whatever the caller's environment says
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if not isinstance(config, Mapping):
        return config
    if trust_remote_code:
        if not model_path or not os.path.isfile(os.path.join(model_path, "config.json")):
            raise ProfileError(f"trustRemoteCode needs the model's code on its volume; {model_path or 'no path'} "
                               "holds no config.json", "spec.model.source")
        try:
            return transformers.AutoConfig.from_pretrained(model_path, trust_remote_code=True, local_files_only=True)
        except Exception as exc:  # noqa: BLE001 - any failure of foreign code is the model's
            raise ProfileError(f"the model's own code cannot build its config: {type(exc).__name__}: {exc}",
                               "spec.model.source") from exc
    model_type = config.get("model_type")
    if not isinstance(model_type, str) or model_type not in CONFIG_MAPPING:
        raise ProfileError(
            f"model_type {model_type!r} is not known to transformers {transformers.__version__}; a model with "
            "its own code needs spec.model.trustRemoteCode and the code on the model volume", "model_type")
    try:
        return CONFIG_MAPPING[model_type].from_dict(dict(config))
    except Exception as exc:  # noqa: BLE001
        raise ProfileError(f"transformers cannot read the config: {type(exc).__name__}: {exc}", "config") from exc


def build_meta_model(config, setup: ProfileSetup, *, trust_remote_code: bool = False):
    """The model on the meta device, as the trainer would set it up (dtype, LoRA, checkpointing)."""
    import torch
    import transformers

    config.use_cache = False
    attn = {"sdpa": "sdpa", "eager": "eager"}[setup.attention]
    dtype = torch.float32 if setup.method == "full" or setup.precision == "fp32" else torch.bfloat16
    def build(attn_implementation: str):
        with warnings.catch_warnings(), torch.device("meta"):
            warnings.simplefilter("ignore")
            return transformers.AutoModelForCausalLM.from_config(
                config, attn_implementation=attn_implementation, dtype=dtype, trust_remote_code=trust_remote_code)

    try:
        try:
            model = build(attn)
        except ValueError as exc:
            # A model transformers runs only with eager attention (gpt-oss: attention sinks) runs eager,
            # as the trainer runs it.
            if attn != "sdpa" or not any(w in str(exc).lower() for w in ("sdpa", "scaled_dot_product_attention")):
                raise
            model = build("eager")
    except Exception as exc:  # noqa: BLE001 - any failure to build is the config's
        raise ProfileError(f"transformers cannot build the model from its config: {type(exc).__name__}: {exc}",
                           "config") from exc
    if setup.method != "full":
        import peft

        from .errors import ConfigError
        from .model_setup import check_modules_to_save, train_in_fp32

        targets = setup.lora_targets if isinstance(setup.lora_targets, str) else list(setup.lora_targets)
        try:
            check_modules_to_save(model, setup.lora_modules_to_save or [])
        except ConfigError as exc:
            raise ProfileError(str(exc), "spec.lora.modulesToSave") from exc
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                model = peft.get_peft_model(model, peft.LoraConfig(
                    r=setup.lora_rank, lora_alpha=setup.lora_alpha, lora_dropout=setup.lora_dropout,
                    target_modules=targets, modules_to_save=setup.lora_modules_to_save or None))
        except ValueError as exc:
            raise ProfileError(f"peft: {exc}", "spec.lora.targetModules") from exc
        train_in_fp32(model)  # the copies of modules_to_save train in fp32, as in the trainer
    if setup.gradient_checkpointing:
        if not getattr(model, "supports_gradient_checkpointing", True):
            raise ProfileError(f"{type(model).__name__} does not support gradient checkpointing",
                               "spec.training.gradientCheckpointing")
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    return model


def _base(model):
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _is_tied(base) -> bool:
    head, embed = base.get_output_embeddings(), base.get_input_embeddings()
    return head is not None and embed is not None and head.weight is embed.weight


def shared_parameters(model) -> list[list[tuple[Any, str]]]:
    """Where one parameter is held by several modules (tied embeddings): (module, attribute) per holder.
    `to_empty` gives each holder its own tensor; `retie` shares them again. Asked of the modules, not
    of `get_output_embeddings`: with peft's modules_to_save the head is a wrapper whose trained copy
    is not tied, while the frozen original it keeps still is."""
    holders: dict[int, list[tuple[Any, str]]] = {}
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            holders.setdefault(id(param), []).append((module, name))
    return [group for group in holders.values() if len(group) > 1]


def retie(groups: list[list[tuple[Any, str]]]) -> None:
    for (first, first_name), *others in groups:
        for module, name in others:
            setattr(module, name, getattr(first, first_name))


def _blocks(base) -> list:
    """The decoder blocks: modules of the model's `_no_split_modules` classes, outermost only."""
    names = set(getattr(base, "_no_split_modules", None) or ())
    blocks, inside = [], set()
    for _, module in base.named_modules():
        if id(module) in inside:
            continue
        if type(module).__name__ in names:
            blocks.append(module)
            inside.update(id(m) for m in module.modules())
    if not blocks:
        raise ProfileError(f"{type(base).__name__} names no decoder block class (_no_split_modules); "
                           "it cannot be sharded with FSDP", "spec.resources.strategy")
    return blocks


def _apply_fsdp(model, mesh) -> None:
    """FSDP2 as transformers applies it at load time (DistributedConfig, the model's default plan).

    The embeddings and every block are their own groups, resharded after forward; the head and
    the other parameter-holding modules (the final norm) form one group kept gathered from
    forward to backward (with tied embeddings the embedding takes the head's place); then the
    root. Mixed precision: param_dtype bf16, reduce_dtype fp32.
    """
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, output_dtype=None)
    base = _base(model)
    tied = _is_tied(base)
    embed, head = base.get_input_embeddings(), base.get_output_embeddings()
    blocks = _blocks(base)
    grouped = {id(m) for b in blocks for m in b.modules()} | {id(m) for m in embed.modules()}
    if head is not None:
        grouped |= {id(m) for m in head.modules()}
    rest = [m for _, m in base.named_modules()
            if id(m) not in grouped and any(True for _ in m.parameters(recurse=False))]
    if not tied:
        fully_shard(embed, mesh=mesh, reshard_after_forward=True, mp_policy=mp)
    for block in blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=True, mp_policy=mp)
    tail = rest + ([embed] if tied else []) + ([head] if head is not None else [])
    fully_shard(tail, mesh=mesh, reshard_after_forward=False, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)


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


def ddp_bucket_layout(params, first_cap: int = 1 << 20, cap: int = 25 << 20) -> list[tuple[int, Any]]:
    """(elements, dtype) of each bucket DDP's C++ Reducer allocates at construction.

    With gradient_as_bucket_view=False (accelerate's default) the Reducer keeps one flat tensor
    per bucket, in the gradient dtype, holding a copy of every trainable gradient: buckets of
    1 MiB first, then 25 MiB, filled in reverse parameter order.
    """
    buckets: list[tuple[int, Any]] = []
    size, limit, dtype, members = 0, first_cap, None, []
    for p in reversed(params):
        nbytes = p.numel() * p.element_size()
        if members and (size + nbytes > limit or p.dtype != dtype):
            buckets.append((sum(m.numel() for m in members), dtype))
            members, size, limit = [], 0, cap
        members.append(p)
        size += nbytes
        dtype = p.dtype
    if members:
        buckets.append((sum(m.numel() for m in members), dtype))
    return buckets


def _rounded(nbytes: int) -> int:
    from .peak_tracker import CUDA_BLOCK_BYTES

    return -(-nbytes // CUDA_BLOCK_BYTES) * CUDA_BLOCK_BYTES


def measure(config, setup: ProfileSetup, *, steps: int = 2, trust_remote_code: bool = False) -> Measurement:
    """Trace `steps` training steps of `setup` (a transformers config, or a config.json dict)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from .peak_tracker import PeakTracker

    if isinstance(config, Mapping):
        config = hf_config(config)
    t0 = time.perf_counter()
    sharded = setup.strategy == "fsdp"
    distributed = setup.world_size > 1 or sharded
    mesh = None
    if distributed:
        _init_fake_world(setup.world_size)
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (setup.world_size,))  # before the fake mode (see module doc)

    model = build_meta_model(config, setup, trust_remote_code=trust_remote_code)
    shared = shared_parameters(model)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    if sharded:
        _apply_fsdp(model, mesh)

    b, s = setup.micro_batch_size, setup.sequence_length
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    # DTensor sharding propagation would otherwise build its global-shape tensors in our mode.
    import torch.distributed.tensor._sharding_prop as sharding_prop

    own_mode = FakeTensorMode(allow_non_fake_inputs=True)
    orig_detect = sharding_prop.detect_fake_mode
    sharding_prop.detect_fake_mode = lambda *a: own_mode
    tracker = PeakTracker()
    step_peaks: list[tuple[int, dict]] = []
    bucket_bytes = 0
    try:
        with _patched_transformers(setup.packing), fake_mode, tracker:
            model.to_empty(device="cpu")
            if not sharded:
                retie(shared)
            params = [p for p in model.parameters() if p.requires_grad]
            layout = ddp_bucket_layout(params) if not sharded else []
            bucket_bytes = sum(_rounded(n * torch.empty((), dtype=d).element_size()) for n, d in layout)
            ddp_buckets = [torch.empty(n, dtype=d) for n, d in layout] if distributed and not sharded else []
            optimizer = torch.optim.AdamW(params, lr=1e-4, fused=True)
            forward = _wrap_forward_like_accelerate(model, setup.precision)
            input_ids = torch.zeros((b, s), dtype=torch.long)
            labels = torch.zeros((b, s), dtype=torch.long)
            # Packed, the collator passes each example's positions and no mask (data.Collator).
            extra = {"position_ids": torch.arange(s).expand(b, s)} if setup.packing else {}
            for _ in range(steps):
                tracker.reset_peak()
                tracker.mark("forward")
                loss = forward(input_ids=input_ids, labels=labels, **extra).loss  # the output is dropped here
                tracker.mark("backward")
                loss.backward()
                del loss
                tracker.mark("optimizer")
                torch.nn.utils.clip_grad_norm_(params, 1.0)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                step_peaks.append((tracker.peak, dict(tracker.phase_peaks)))
            del input_ids, labels, ddp_buckets, extra
    finally:
        sharding_prop.detect_fake_mode = orig_detect
        if distributed:
            # Leave no process group behind: callers in the same process (tests) must not
            # inherit a fake world.
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
    peak, phases = step_peaks[-1]
    return Measurement(peak_bytes=peak, phase_peaks=phases, first_step_peak=step_peaks[0][0],
                       wall_s=time.perf_counter() - t0, trainable_params=trainable, ddp_bucket_bytes=bucket_bytes)


# ---------------------------------------------------------------------------
# the profile: shape, parameter counts, measured setups
# ---------------------------------------------------------------------------


def shape_of(config) -> ProfileShape:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    hidden = int(text.hidden_size)
    heads = int(getattr(text, "num_attention_heads", 0) or 1)
    kv = int(getattr(text, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(text, "head_dim", None) or max(1, hidden // heads))
    inter = int(getattr(text, "intermediate_size", None) or getattr(text, "ffn_dim", None) or 4 * hidden)
    return ProfileShape(
        model_type=str(config.model_type), hidden_size=hidden, num_layers=int(text.num_hidden_layers),
        vocab_size=int(text.vocab_size), num_attention_heads=heads, num_key_value_heads=kv, head_dim=head_dim,
        intermediate_size=inter, tie_word_embeddings=bool(getattr(text, "tie_word_embeddings", False)))


def param_counts(config, *, trust_remote_code: bool = False) -> dict[str, int]:
    """Parameters of the model (meta device): total, the input embedding, the head (0 when tied)."""
    import torch
    import transformers

    with warnings.catch_warnings(), torch.device("meta"):
        warnings.simplefilter("ignore")
        model = transformers.AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    tied = _is_tied(model)
    return {
        "total": sum(p.numel() for p in model.parameters()),
        "embedding": embed.weight.numel() if embed is not None else 0,
        "lmHead": 0 if (tied or head is None) else head.weight.numel(),
    }


def run_profile(request: ProfileRequest) -> ProfileReport:
    """Measure every setup of the request; a model that cannot be built is a report with the reason."""
    try:
        config = hf_config(request.config, model_path=request.model_path,
                           trust_remote_code=request.trust_remote_code)
        shape = shape_of(config)
        try:
            params = param_counts(config, trust_remote_code=request.trust_remote_code)
        except Exception as exc:  # noqa: BLE001 - a model whose own __init__ refuses the config (Falcon: heads)
            raise ProfileError(f"transformers cannot build the model from its config: {type(exc).__name__}: {exc}",
                               "config") from exc
        measurements = []
        for setup in request.setups:
            m = measure(config, setup, trust_remote_code=request.trust_remote_code)
            measurements.append(ProfileMeasurement(
                key=setup.key, peaks={k: int(m.phase_peaks.get(k, 0)) for k in PROFILE_PHASES},
                trainable_params=m.trainable_params, ddp_bucket_bytes=m.ddp_bucket_bytes,
                seconds=round(m.wall_s, 2)))
    except ProfileError as exc:
        return ProfileReport(ok=False, error=str(exc), error_field=exc.field)
    except Exception as exc:  # noqa: BLE001 - tracing foreign model code can fail in any way
        return ProfileReport(ok=False, error=f"tracing the training step failed: {type(exc).__name__}: {exc}")
    return ProfileReport(ok=True, shape=shape, params=params, measurements=measurements)


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m finetune_trainer.profile", description=__doc__.split("\n\n")[0])
    parser.add_argument("--request", help=f"a ProfileRequest JSON file (default: the {PROFILE_REQUEST_ENV} variable)")
    parser.add_argument("--report-path", default=DEFAULT_REPORT_PATH)
    args = parser.parse_args(argv)
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    try:
        text = open(args.request).read() if args.request else os.environ[PROFILE_REQUEST_ENV]
        request = ProfileRequest.model_validate_json(text)
    except (OSError, KeyError, ValueError) as exc:
        report = ProfileReport(ok=False, error=f"no valid profile request: {exc}")
    else:
        report = run_profile(request)
    message = report.to_termination_message()
    sys.stdout.write(json.dumps({"event": "profile", **json.loads(message)}) + "\n")
    sys.stdout.flush()
    try:
        with open(args.report_path, "w") as handle:
            handle.write(message)
    except OSError as exc:
        sys.stderr.write(f"cannot write the profile report to {args.report_path}: {exc}\n")
    return EXIT_OK if report.ok else EXIT_CONFIG_ERROR


if __name__ == "__main__":
    sys.exit(main())

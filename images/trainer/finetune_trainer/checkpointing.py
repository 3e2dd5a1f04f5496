"""Checkpoints: atomic, keep the last K, resume from the newest complete one.

Layout under the checkpoint directory::

    step-00000040/            complete (renamed into place only after everything is written)
      meta.json               CheckpointMeta
      scheduler.pt            LR scheduler state (rank 0)
      dcp/                    model (+ optimizer) via torch.distributed.checkpoint   (ddp, fsdp)
      deepspeed/state/        DeepSpeed's own checkpoint                             (zero1/2/3)
    .staging-step-00000060/   being written; removed at the next start

torch.distributed.checkpoint stores tensors by their fully qualified names with
sharding metadata, so a checkpoint written by N ranks under DDP or FSDP loads on M
ranks under DDP or FSDP, optimizer state included (for LoRA only the adapters and
their optimizer state are stored). A DeepSpeed checkpoint resumes fully on the same
ZeRO stage and world size; anywhere else the weights are recovered with DeepSpeed's
zero_to_fp32 and the optimizer starts fresh (logged as ``optimizerRestored: false``).
``meta.json`` records the optimizer too: state of another optimizer (AdamW moments into
an 8-bit optimizer, or the reverse) is never loaded; the weights, LR schedule, step and
data position still are, and the resume says why the optimizer starts fresh.

A checkpoint is on a volume the job's author writes: its pickled files are read only as
data (``untrusted.py``), checked by ``check_files`` before the attempt loads anything, and
a file that would run code is a ``DataError`` naming it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from . import untrusted
from .reporting import log_json

_STEP_DIR = re.compile(r"^step-(\d{8})$")
DCP_DIR = "dcp"
DS_DIR = "deepspeed"
DS_TAG = "state"


# What a checkpoint written before optimizers were recorded was trained with: the
# contract's default, the only optimizer those trainers could have run on CPU or without
# an 8-bit rung.
LEGACY_OPTIMIZER = "adamw"


@dataclass
class CheckpointMeta:
    step: int
    samples_consumed: int
    world_size: int
    strategy: str
    method: str
    format: str  # "dcp" | "deepspeed"
    micro_batch_size: int
    gradient_accumulation: int
    attempt: int
    # The optimizer whose state the checkpoint holds (TrainerConfig.optimizer). None in
    # checkpoints written before it was recorded: read as LEGACY_OPTIMIZER.
    optimizer: str | None = None
    # TrainerConfig.master_weights / update_rounding of the attempt that wrote it (None:
    # written before they existed, i.e. fp32). Informational: fp32 and bf16 weights and
    # AdamW moments load into each other (cast to the parameter's dtype).
    master_weights: str | None = None
    update_rounding: str | None = None

    @property
    def optimizer_or_legacy(self) -> str:
        return self.optimizer or LEGACY_OPTIMIZER

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @classmethod
    def from_json(cls, text: str) -> "CheckpointMeta":
        data = json.loads(text)
        if not isinstance(data, dict):
            raise ValueError("meta.json is not an object")
        # Keys this trainer does not know (a newer trainer's) are ignored, not fatal:
        # an unreadable meta.json hides the checkpoint and the job would start over.
        known = {f.name for f in fields(cls)}
        return cls(**{key: value for key, value in data.items() if key in known})


@dataclass
class Checkpoint:
    path: Path
    meta: CheckpointMeta


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def list_checkpoints(root: str | Path) -> list[Checkpoint]:
    """Complete checkpoints, oldest first. Anything without a readable meta.json is skipped."""
    root = Path(root)
    found = []
    if not root.is_dir():
        return found
    for entry in root.iterdir():
        if not _STEP_DIR.match(entry.name) or not entry.is_dir():
            continue
        try:
            meta = CheckpointMeta.from_json((entry / "meta.json").read_text())
        except (OSError, ValueError, TypeError):
            continue
        found.append(Checkpoint(entry, meta))
    return sorted(found, key=lambda c: c.meta.step)


def newest_checkpoint(root: str | Path) -> Checkpoint | None:
    checkpoints = list_checkpoints(root)
    return checkpoints[-1] if checkpoints else None


def clean_staging(root: str | Path) -> None:
    """Remove half-written checkpoints of an attempt that died while saving (rank 0)."""
    root = Path(root)
    if root.is_dir():
        for entry in root.iterdir():
            if entry.name.startswith(".staging-"):
                shutil.rmtree(entry, ignore_errors=True)


def prune(root: str | Path, keep_last: int) -> list[Path]:
    removed = []
    for checkpoint in list_checkpoints(root)[:-keep_last]:
        # Rename first so a half-deleted folder never looks complete.
        doomed = checkpoint.path.with_name(".staging-deleting-" + checkpoint.path.name)
        os.rename(checkpoint.path, doomed)
        shutil.rmtree(doomed, ignore_errors=True)
        removed.append(checkpoint.path)
    return removed


def fsync_dir(path: Path) -> None:
    """Make a rename inside `path` durable (checkpoints here, the export's folder in export.py)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ----------------------------------------------------------------------- torch side


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _is_rank0() -> bool:
    import torch.distributed as dist

    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def _plain_optimizer(optimizer):
    # accelerate wraps the torch optimizer; DCP needs the torch one. With the optimizer
    # step in backward, the per-parameter optimizers (DCP takes a list and keys their
    # state by parameter name, as for one optimizer).
    plain = getattr(optimizer, "optimizer", optimizer)
    per_parameter = getattr(plain, "plain_optimizers", None)
    return per_parameter() if callable(per_parameter) else plain


def _options(lora: bool, **extra):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(ignore_frozen_params=lora, **extra)


def save_checkpoint(
    *, root: Path, meta: CheckpointMeta, model, optimizer, scheduler, deepspeed_engine, lora: bool, keep_last: int
) -> Path:
    """Collective: every rank calls it. Returns the final path."""
    import torch
    import torch.distributed.checkpoint as dcp

    final = root / step_dir_name(meta.step)
    staging = root / f".staging-{step_dir_name(meta.step)}"
    if _is_rank0():
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir()
    _barrier()
    if deepspeed_engine is not None:
        deepspeed_engine.save_checkpoint(str(staging / DS_DIR), tag=DS_TAG, save_latest=True)
    else:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        # Optimizer state flattened to one entry per parameter name (param_groups too): a
        # checkpoint then loads whatever the grouping, one optimizer or one per parameter
        # (the optimizer step in backward), on either side of a resume.
        model_sd, optim_sd = get_state_dict(model, _plain_optimizer(optimizer),
                                            options=_options(lora, flatten_optimizer_state_dict=True))
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(staging / DCP_DIR))
    _barrier()
    if _is_rank0():
        torch.save(scheduler.state_dict(), staging / "scheduler.pt")
        # meta.json last: its presence marks the content complete, the rename publishes it.
        with open(staging / "meta.json", "w") as handle:
            handle.write(meta.to_json())
            handle.flush()
            os.fsync(handle.fileno())
        fsync_dir(staging)
        if final.exists():  # the same step saved by an earlier attempt
            shutil.rmtree(final)
        os.rename(staging, final)
        fsync_dir(root)
        removed = prune(root, keep_last)
        log_json("checkpoint", step=meta.step, path=str(final), samplesConsumed=meta.samples_consumed,
                 pruned=[str(p) for p in removed])
    _barrier()
    return final


def optimizer_restore(checkpoint: Checkpoint, strategy: str, world_size: int,
                      optimizer: str = LEGACY_OPTIMIZER) -> tuple[bool, str | None]:
    """Whether this attempt can load the checkpoint's optimizer state, and if not, why.

    The state must be of the same optimizer (AdamW's fp32 moments are not an 8-bit
    optimizer's quantised ones, nor the reverse) and in a layout this attempt can read:
    a torch.distributed.checkpoint (ddp/fsdp) reshards into ddp/fsdp on any world size;
    DeepSpeed's own checkpoint loads only into the same ZeRO stage and world size.
    """
    meta = checkpoint.meta
    if meta.optimizer_or_legacy != optimizer:
        return False, (f"the checkpoint holds {meta.optimizer_or_legacy} optimizer state and this attempt runs "
                       f"{optimizer}")
    if meta.format == "dcp":
        if strategy not in ("ddp", "fsdp"):
            return False, f"a {meta.strategy} checkpoint's optimizer state does not load into {strategy}"
        return True, None
    if meta.strategy != strategy or meta.world_size != world_size:
        return False, (f"DeepSpeed optimizer state of {meta.strategy} on {meta.world_size} ranks loads only into "
                       f"the same (this attempt: {strategy} on {world_size})")
    return True, None


def can_restore_optimizer(checkpoint: Checkpoint, strategy: str, world_size: int,
                          optimizer: str = LEGACY_OPTIMIZER) -> bool:
    return optimizer_restore(checkpoint, strategy, world_size, optimizer)[0]


def load_full_state(checkpoint: Checkpoint, *, model, optimizer, deepspeed_engine, lora: bool) -> None:
    """Model and optimizer state, when ``can_restore_optimizer`` says so (collective)."""
    if checkpoint.meta.format == "deepspeed":
        untrusted.check_deepspeed_files(checkpoint.path / DS_DIR)
        deepspeed_engine.load_checkpoint(
            str(checkpoint.path / DS_DIR),
            tag=DS_TAG,
            load_optimizer_states=True,
            load_lr_scheduler_states=False,
            load_module_strict=not lora,
        )
        return
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    plain = _plain_optimizer(optimizer)
    saved = set(untrusted.safe_file_system_reader(checkpoint.path / DCP_DIR).read_metadata().state_dict_metadata)
    # Checkpoints written before the flattened layout number their param groups
    # ("optim.param_groups.0.lr"); they load into the same grouping, as they always did.
    flat = not any(re.match(r"optim\.param_groups\.\d+\.", key) for key in saved)
    model_sd, optim_sd = get_state_dict(model, plain, options=_options(lora, flatten_optimizer_state_dict=flat))
    state = {"model": model_sd, "optim": optim_sd}
    kept = _state_the_checkpoint_lacks(optim_sd, saved, checkpoint)
    dcp.load(state, storage_reader=untrusted.safe_file_system_reader(checkpoint.path / DCP_DIR))
    _put_back(optim_sd, kept)
    # Under LoRA the checkpoint holds only the adapters: the frozen base is not missing.
    result = set_state_dict(model, plain, model_state_dict=state["model"], optim_state_dict=state["optim"],
                            options=_options(lora, strict=not lora, flatten_optimizer_state_dict=flat))
    _check_loaded(result, lora)


def _state_the_checkpoint_lacks(optim_sd: dict, saved: set[str], checkpoint: Checkpoint) -> dict:
    """Optimizer state entries this attempt has and the checkpoint does not (a Kahan
    buffer when the checkpoint was written with fp32 master weights or another rounding,
    as after a recovery step that switched masterWeights): taken out of what is loaded
    and kept at their fresh value (zero: nothing lost to rounding yet). Weights and the
    AdamW moments still load, cast to this attempt's dtypes."""
    kept = {}
    if "state" in optim_sd and isinstance(optim_sd["state"], dict):  # nested (older layout)
        for fqn, entries in optim_sd["state"].items():
            for key in list(entries):
                if f"optim.state.{fqn}.{key}" not in saved:
                    kept[("state", fqn, key)] = entries.pop(key)
    else:  # flattened: "state.<fqn>.<key>"
        for name in list(optim_sd):
            if name.startswith("state.") and f"optim.{name}" not in saved:
                kept[(name,)] = optim_sd.pop(name)
    if kept:
        names = sorted({path[-1].rsplit(".", 1)[-1] for path in kept})
        log_json("info", message=f"checkpoint {checkpoint.path} holds no optimizer state {', '.join(names)} "
                                 f"({len(kept)} tensors): those start fresh, the rest of the state loads")
    return kept


def _put_back(optim_sd: dict, kept: dict) -> None:
    for path, value in kept.items():
        if path[0] == "state" and len(path) == 3:
            optim_sd["state"][path[1]][path[2]] = value
        else:
            optim_sd[path[0]] = value


def load_weights(checkpoint: Checkpoint, model, lora: bool) -> None:
    """Weights only, into a model not yet wrapped by DeepSpeed (DDP-plain, FSDP or ZeRO-3 partitioned)."""
    if checkpoint.meta.format == "dcp":
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        if _is_zero3_partitioned(model):
            full = _dcp_full_state(checkpoint)
        else:
            model_sd = get_model_state_dict(model, options=_options(lora))
            dcp.load({"model": model_sd}, storage_reader=untrusted.safe_file_system_reader(checkpoint.path / DCP_DIR))
            _set_model(model, model_sd, lora, full=False)
            return
    else:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        untrusted.check_deepspeed_files(checkpoint.path / DS_DIR)
        full = get_fp32_state_dict_from_zero_checkpoint(str(checkpoint.path / DS_DIR), tag=DS_TAG)
    if _is_zero3_partitioned(model):
        _load_into_zero3(model, full)
    else:
        _set_model(model, full, lora, full=True)


def _set_model(model, state_dict, lora: bool, full: bool) -> None:
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    result = set_model_state_dict(model, state_dict, options=_options(lora, full_state_dict=full, strict=False))
    _check_loaded(result, lora)


def _check_loaded(result, lora: bool) -> None:
    """Every trainable tensor must come from the checkpoint (all of them for full fine-tuning; under
    LoRA the adapters and the copies peft trains of lora.modulesToSave)."""
    missing = [k for k in getattr(result, "missing_keys", [])
               if not lora or "lora_" in k or ".modules_to_save." in k]
    if missing:
        raise RuntimeError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")


def _dcp_full_state(checkpoint: Checkpoint) -> dict:
    """The checkpoint's whole model state on the host (each rank reads it; no process group)."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    folder = checkpoint.path / DCP_DIR
    metadata = untrusted.safe_file_system_reader(folder).read_metadata()
    prefix = "model."
    model = {key[len(prefix):]: torch.empty(entry.size, dtype=entry.properties.dtype)
             for key, entry in metadata.state_dict_metadata.items()
             if key.startswith(prefix) and isinstance(entry, TensorStorageMetadata)}
    dcp.load({"model": model}, storage_reader=untrusted.safe_file_system_reader(folder), no_dist=True)
    return model


def _is_zero3_partitioned(model) -> bool:
    return any(hasattr(p, "ds_id") for p in model.parameters())


def _load_into_zero3(model, state_dict: dict) -> None:
    import deepspeed
    import torch

    for name, param in model.named_parameters():
        if name not in state_dict:
            continue
        with deepspeed.zero.GatheredParameters([param], modifier_rank=0):
            if _is_rank0():
                with torch.no_grad():
                    param.copy_(state_dict[name].to(param.dtype))


def check_files(checkpoint: Checkpoint) -> None:
    """Every pickled file of the checkpoint read as data only, before anything loads it: a
    file that would run code raises DataError naming it (untrusted.py). A file that is absent is
    the loader's to report, as before: this check is about what a present file would run."""
    scheduler = checkpoint.path / "scheduler.pt"
    if scheduler.exists():
        untrusted.load_tensors(scheduler)
    if checkpoint.meta.format == "dcp":
        metadata = checkpoint.path / DCP_DIR / ".metadata"
        if metadata.exists():
            untrusted.load_dcp_metadata(metadata)
    else:
        untrusted.check_deepspeed_files(checkpoint.path / DS_DIR)


def load_scheduler(checkpoint: Checkpoint, scheduler, optimizer) -> None:
    state = untrusted.load_tensors(checkpoint.path / "scheduler.pt")
    groups = len(optimizer.param_groups)
    for key in ("base_lrs", "_last_lr"):
        saved = state.get(key)
        # Another grouping than the checkpoint's (one optimizer <-> one per parameter,
        # the step in backward switched on or off): every group of this trainer has the
        # same base learning rate, so the schedule is one number per group.
        if isinstance(saved, list) and saved and len(saved) != groups:
            if len(set(saved)) != 1:
                raise RuntimeError(f"checkpoint {checkpoint.path}: {key} {saved} differ per group; cannot regroup")
            state[key] = saved[:1] * groups
    scheduler.load_state_dict(state)
    # The learning rate lives in the optimizer; a fresh optimizer must get it too.
    for group, lr in zip(optimizer.param_groups, scheduler.get_last_lr()):
        group["lr"] = lr

"""Reading files the tenant can write (checkpoints on their volume) without running them.

A pickle is a program: unpickling a crafted file calls any importable function with
arguments of the file's choosing. Checkpoints live on a volume the job's author writes,
so every pickle the trainer reads from one goes through a loader that builds only data:

- ``torch.load`` with ``weights_only=True`` (torch's own restricted unpickler: tensors,
  containers and plain types) for ``scheduler.pt`` and the consolidated weights;
- torch.distributed.checkpoint's ``.metadata`` (a plain pickle that DCP's own
  ``FileSystemReader`` loads with ``pickle.load``) through ``SafeFileSystemReader``, whose
  unpickler resolves only the few classes that file is made of;
- DeepSpeed's checkpoint files, which DeepSpeed itself loads with ``weights_only=False``:
  ``check_deepspeed_files`` first opens each with ``weights_only=True`` and only the plain
  DeepSpeed types of ``DEEPSPEED_SAFE_GLOBALS`` allowed, so a file that would run anything
  else is refused before DeepSpeed opens it.

A refused file is a ``DataError`` naming it: the attempt fails without retrying (the same
file would be refused again) and nothing in the file runs.
"""

from __future__ import annotations

import pickle
from pathlib import Path

from .errors import DataError

# (module, name) pairs a DCP .metadata file is made of (torch 2.x): the metadata dataclasses,
# the storage index, torch.Size, and the layout lookup by name. torch dtypes are allowed by
# type below (torch pickles a dtype as the global torch.<name>).
_DCP_METADATA_GLOBALS = {
    ("torch.distributed.checkpoint.metadata", name)
    for name in ("Metadata", "TensorStorageMetadata", "TensorProperties", "ChunkStorageMetadata",
                 "BytesStorageMetadata", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    # _get_layout("torch.strided") looks a layout up by name; it calls nothing else.
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("collections", "OrderedDict"),
}


def refused(path: str | Path, why: str) -> DataError:
    return DataError(f"checkpoint file {path} is refused: {why} (a checkpoint holds tensors and plain values; "
                     f"this file would run code when loaded, so it was not loaded)")


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) in _DCP_METADATA_GLOBALS:
            return super().find_class(module, name)
        if module == "torch":
            import torch

            value = getattr(torch, name, None)
            if isinstance(value, torch.dtype):
                return value
        raise pickle.UnpicklingError(f"global {module}.{name} is not allowed")


def load_dcp_metadata(path: str | Path):
    """The DCP ``.metadata`` at ``path``, unpickled with only its own classes resolvable."""
    try:
        with open(path, "rb") as handle:
            return _MetadataUnpickler(handle).load()
    except pickle.UnpicklingError as exc:
        raise refused(path, str(exc)) from exc


def safe_file_system_reader(directory: str | Path):
    """A torch.distributed.checkpoint FileSystemReader whose metadata is read by
    ``load_dcp_metadata``, once, here: a refused file raises DataError from this call, not
    from inside ``dcp.load`` (which would bury it in its own exception). DCP reads each
    tensor's bytes itself, and its byte entries with ``weights_only=True``."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    reader = FileSystemReader(str(directory))
    metadata = load_dcp_metadata(reader._get_metadata_path(None))

    class SafeFileSystemReader(FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            if kwargs.get("rank") is not None:
                # Rank-local metadata (not written by this trainer's saves): read as data too.
                found = load_dcp_metadata(self._get_metadata_path(kwargs["rank"]))
            else:
                found = metadata
            if getattr(found, "storage_meta", None) is None:
                found.storage_meta = StorageMeta()
            found.storage_meta.load_id = self.load_id
            return found

    return SafeFileSystemReader(str(directory))


def load_tensors(path: str | Path, *, mmap: bool = False):
    """``torch.load`` of a file of tensors and plain values; anything else is a DataError naming it."""
    import torch

    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as exc:
        raise refused(path, _first_line(exc)) from exc


def _first_line(exc: BaseException) -> str:
    # torch's weights-only message is a page long; its first lines name the global.
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    wanted = [line for line in lines if "GLOBAL" in line or "Unsupported" in line]
    return (wanted or lines or [type(exc).__name__])[0][:300]


def deepspeed_safe_globals() -> list:
    """The classes DeepSpeed 0.19 writes into its checkpoint files besides tensors and
    containers: the ZeRO stage enum, the loss scaler's record of its scale and the record of
    a parameter's place in a flat partition (plain attributes; unpickling sets them and calls
    nothing)."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [ZeroStageEnum, LossScaler, DynamicLossScaler, fragment_address]


def check_deepspeed_files(directory: str | Path) -> None:
    """Open every file of a DeepSpeed checkpoint as DeepSpeed would, but with only data
    allowed; a file that needs anything else is refused before DeepSpeed loads it."""
    import torch

    for path in sorted(Path(directory).rglob("*")):
        if not path.is_file() or path.suffix not in (".pt", ".bin", ".pth"):
            continue
        with torch.serialization.safe_globals(deepspeed_safe_globals()):
            load_tensors(path, mmap=True)

"""The safetensors format read and written one tensor at a time, with plain file reads and writes.

Why not the safetensors package: its reader maps the whole file, so every page of a shard a
merge has read stays resident (and counted in the process's RSS and the pod's memory) until the
file is closed, and its writer (``save_file``) makes a bytes copy of every tensor of a shard
before it writes any. A merge that must never hold two copies of a model (export.py) reads each
tensor into its own buffer with ``readinto`` and writes it as soon as it is computed, under a
header planned beforehand from the shapes alone.

The format (the safetensors project's documentation): an 8-byte little-endian header length N,
N bytes of JSON ``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}``
(offsets relative to the end of the header, packed in order, no gaps), then the data. The header
is padded with spaces to a multiple of 8 bytes. Files written here load with the safetensors
package, transformers, vLLM and TGI; the tests check that against the package itself.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

import torch

# safetensors dtype codes and their torch types (what a checkpoint of a language model holds).
DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
CODES: dict[torch.dtype, str] = {dtype: code for code, dtype in DTYPES.items()}
# A header larger than this is not a checkpoint's (the safetensors package refuses 100 MB too).
MAX_HEADER_BYTES = 100_000_000


class FormatError(ValueError):
    """A file that is not a well-formed safetensors file (the message names it)."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()


@dataclass(frozen=True)
class StoredTensor:
    info: TensorInfo
    begin: int  # absolute file offsets of its bytes
    end: int


class SafetensorsFile:
    """A safetensors file's header, checked, and its tensors read one at a time."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.tensors: dict[str, StoredTensor] = {}
        self.metadata: dict[str, str] = {}
        self._read_header()

    def _read_header(self) -> None:
        size = self.path.stat().st_size
        with open(self.path, "rb") as handle:
            raw = handle.read(8)
            if len(raw) != 8:
                raise FormatError(f"{self.path}: too short for a safetensors file")
            (length,) = struct.unpack("<Q", raw)
            if length > MAX_HEADER_BYTES or 8 + length > size:
                raise FormatError(f"{self.path}: header length {length} does not fit the file ({size} bytes)")
            try:
                header = json.loads(handle.read(length))
            except ValueError as exc:
                raise FormatError(f"{self.path}: header is not JSON ({exc})") from None
        if not isinstance(header, dict):
            raise FormatError(f"{self.path}: header is not a JSON object")
        data_start = 8 + length
        metadata = header.pop("__metadata__", None) or {}
        if not isinstance(metadata, dict):
            raise FormatError(f"{self.path}: __metadata__ is not an object")
        self.metadata = {str(k): str(v) for k, v in metadata.items()}
        for name, entry in header.items():
            try:
                dtype = DTYPES[entry["dtype"]]
                shape = tuple(int(d) for d in entry["shape"])
                begin, end = (int(x) for x in entry["data_offsets"])
            except (KeyError, TypeError, ValueError):
                raise FormatError(f"{self.path}: tensor {name!r} has an unreadable entry {entry!r}") from None
            info = TensorInfo(name, dtype, shape)
            if any(d < 0 for d in shape) or end - begin != info.nbytes or begin < 0 or data_start + end > size:
                raise FormatError(f"{self.path}: tensor {name!r} ({entry['dtype']} {list(shape)}) has offsets "
                                  f"[{begin}, {end}] that do not match its size or the file")
            self.tensors[name] = StoredTensor(info, data_start + begin, data_start + end)

    def names(self) -> list[str]:
        """In file order (how the data lies, so reading in this order reads the file front to back)."""
        return sorted(self.tensors, key=lambda n: self.tensors[n].begin)

    def info(self, name: str) -> TensorInfo:
        return self.tensors[name].info

    def read(self, name: str) -> torch.Tensor:
        """The tensor `name`, in a buffer of its own (nothing of the file stays mapped)."""
        stored = self.tensors[name]
        tensor = torch.empty(stored.info.shape, dtype=stored.info.dtype)
        if stored.end == stored.begin:
            return tensor
        view = memoryview(tensor.view(-1).view(torch.uint8).numpy())
        with open(self.path, "rb") as handle:
            handle.seek(stored.begin)
            got = handle.readinto(view)
        if got != stored.end - stored.begin:
            raise FormatError(f"{self.path}: tensor {name!r} is cut short ({got} of {stored.end - stored.begin} bytes)")
        return tensor

    def read_all(self) -> dict[str, torch.Tensor]:
        return {name: self.read(name) for name in self.names()}


def header_bytes(infos: Iterable[TensorInfo], metadata: dict[str, str] | None = None) -> bytes:
    """The length prefix and padded JSON header of a file holding `infos` in this order."""
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = metadata
    offset = 0
    for info in infos:
        header[info.name] = {"dtype": CODES[info.dtype], "shape": list(info.shape),
                             "data_offsets": [offset, offset + info.nbytes]}
        offset += info.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def write_file(path: str | Path, infos: list[TensorInfo], tensors: Iterator[torch.Tensor],
               metadata: dict[str, str] | None = None) -> None:
    """Write `tensors` (produced one at a time, in the order of `infos`) to `path`, then fsync.

    Each tensor must match its planned dtype and shape; nothing is buffered beyond the one tensor."""
    with open(path, "wb") as handle:
        handle.write(header_bytes(infos, metadata))
        for info, tensor in zip(infos, tensors, strict=True):
            if tensor.dtype != info.dtype or tuple(tensor.shape) != info.shape:
                raise ValueError(f"{info.name}: produced {tensor.dtype} {list(tensor.shape)}, planned "
                                 f"{info.dtype} {list(info.shape)}")
            if info.nbytes:
                handle.write(memoryview(tensor.detach().contiguous().view(-1).view(torch.uint8).numpy()))
        handle.flush()
        os.fsync(handle.fileno())

"""Activation offloading (``activationOffloading``): what activation checkpointing keeps
of each layer (its inputs) lives in host memory between forward and backward.

With activation checkpointing (non-reentrant, as the trainer runs it) a checkpointed
layer keeps only its inputs for the recompute in backward; torch saves them through the
saved-tensor hooks active when the checkpoint is entered. This module's checkpoint
function enters a ``saved_tensors_hooks`` context around the checkpoint call: each
saved tensor that lives on an accelerator is copied to host memory (pinned, with a
non-blocking copy, on CUDA only; pinned pages are what make the copy asynchronous),
and copied back when backward needs it. Tensors already on the host (the CPU runs of
the tests, or anything small) are still copied, so the mechanism and its byte count are
the same everywhere. Inside the checkpointed region torch's own hooks take over (nothing
is saved there), so only the layer inputs move, which is what the host-memory term of
the estimate counts: layers x micro-batch x sequence x hidden x 2 bytes (bf16).

Installed by replacing each checkpointed layer's ``_gradient_checkpointing_func``
after transformers enabled checkpointing; ``OffloadStats`` counts what moved.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch.utils.checkpoint import checkpoint


@dataclass
class OffloadStats:
    tensors: int = 0
    bytes: int = 0
    # Bytes on the host at once at most (saved in forward, released in backward).
    live_bytes: int = 0
    peak_live_bytes: int = 0


class _Offloader:
    def __init__(self, stats: OffloadStats):
        self.stats = stats
        self.pin = torch.cuda.is_available()

    def pack(self, tensor: torch.Tensor):
        if tensor.is_sparse or tensor.device.type == "meta":
            return tensor
        pin = self.pin and tensor.device.type == "cuda"
        host = torch.empty(tensor.size(), dtype=tensor.dtype, layout=tensor.layout, pin_memory=pin)
        host.copy_(tensor, non_blocking=pin)
        size = tensor.numel() * tensor.element_size()
        stats = self.stats
        stats.tensors += 1
        stats.bytes += size
        stats.live_bytes += size
        stats.peak_live_bytes = max(stats.peak_live_bytes, stats.live_bytes)
        return (tensor.device, host, size)

    def unpack(self, packed):
        if isinstance(packed, torch.Tensor):
            return packed
        device, host, size = packed
        self.stats.live_bytes -= size
        return host.to(device, non_blocking=host.is_pinned())


def offloading_checkpoint(offloader: _Offloader, function, *args, **kwargs):
    with torch.autograd.graph.saved_tensors_hooks(offloader.pack, offloader.unpack):
        return checkpoint(function, *args, **kwargs)


def install(model, use_reentrant: bool = False) -> OffloadStats:
    """Make every layer that transformers checkpoints offload its saved inputs.
    Call after checkpointing is enabled; returns the counters."""
    stats = OffloadStats()
    func = functools.partial(offloading_checkpoint, _Offloader(stats), use_reentrant=use_reentrant)
    layers = 0
    for module in model.modules():
        if getattr(module, "gradient_checkpointing", False) and hasattr(module, "_gradient_checkpointing_func"):
            module._gradient_checkpointing_func = func
            layers += 1
    if layers == 0:
        raise ValueError("activation offloading found no checkpointed layer: is gradient checkpointing on?")
    return stats

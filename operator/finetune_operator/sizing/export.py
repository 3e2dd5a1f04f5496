"""Host memory and disk of the export after training (spec.export; the trainer's export.py).

The export runs in the training pod, on rank 0, on the CPU, after training succeeded and the
other ranks have exited (their memory is free again). It streams: one tensor is read into its own
buffer, merged in fp32 when the adapter touches it, cast to the training dtype and written before
the next is read; nothing of the model is held beyond that tensor (the trainer's safetensors_io
reads with ``readinto``, so no shard stays mapped). Its peak resident memory is therefore

    the training process's own runtime (HOST_PROCESS_BYTES: Python, torch, CUDA libraries)
  + the working set of the largest tensor: for a tensor the adapter changes, its bytes as stored
    plus its fp32 copy (then the fp32 copy plus the cast result), for QLoRA also the 4-bit
    round trip; for any other tensor its bytes as stored plus the cast result when the dtype changes
  + MERGE_OVERHEAD_BYTES (the BLAS library's GEMM buffers, the allocator's slack).

The adapter is read pair by pair (each LoRA A and B when its weight is merged), so it adds only a
few MiB. The largest tensor is the embedding matrix or the output head (vocabulary x hidden), or
a block's largest matrix; expert matrices are counted fused (experts x in x out), as checkpoints
that store them fused hold them (per-expert checkpoints need less). bench/export_memory.py
measures the peak against this estimate.

Disk: the folder's weights in the training dtype (every parameter once; tied embeddings once),
written beside what the Trainer saved (the adapter, or for full fine-tuning its own save, in fp32
with fp32 master weights).
"""

from __future__ import annotations

from dataclasses import dataclass

from .architecture import ModelArchitecture
from .constants import HOST_PROCESS_BYTES

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
FP32 = 4
NF4_PACKED_BYTES = 0.5  # bitsandbytes' packed 4-bit weights, per element (its scales are ~1/64 of that again)
# Beyond the tensors: MKL's GEMM buffers (allocated at the first merge and kept) and the allocator's
# slack. bench/export_memory.py measured 50-65 MiB above the working set with one or two threads; twice
# that is planned.
MERGE_OVERHEAD_BYTES = 128 << 20


@dataclass(frozen=True)
class ExportEstimate:
    kind: str  # merged | full
    host_bytes: int  # peak resident memory of the exporting process
    disk_bytes: int  # the exported weights
    largest_tensor_elements: int
    working_set_bytes: int  # of the largest tensor's merge (part of host_bytes)
    overhead_bytes: int = MERGE_OVERHEAD_BYTES  # BLAS buffers and allocator slack (part of host_bytes)

    def to_json(self) -> dict[str, object]:
        return {"kind": self.kind, "hostBytes": self.host_bytes, "diskBytes": self.disk_bytes,
                "largestTensorElements": self.largest_tensor_elements, "workingSetBytes": self.working_set_bytes,
                "overheadBytes": self.overhead_bytes}


def _merged_working_set(elements: int, stored: int, out: int, compute: int, qlora: bool) -> float:
    """Bytes alive at once while one adapted tensor is merged (export._Producer.tensor)."""
    steps = [stored + FP32, FP32 + out]
    if qlora:  # W cast to the compute dtype, its 4-bit form, the dequantised copy; then the fp32 copy
        steps += [stored + compute + NF4_PACKED_BYTES + compute, compute + FP32]
    return max(steps) * elements


def _plain_working_set(elements: int, stored: int, out: int) -> float:
    return (stored + (out if out != stored else 0)) * elements


def estimate_export(arch: ModelArchitecture, *, export: str, method: str, precision: str,
                    lora_targets: str | tuple[str, ...] = "all-linear", stored_bytes: int = 2,
                    trained_bytes: int = FP32, modules_to_save: tuple[str, ...] = ()) -> ExportEstimate | None:
    """The export's host memory and disk; None for `adapter` (nothing is written beyond the adapter).

    `stored_bytes`: bytes per element of the base checkpoint on disk (2 for a 16-bit base);
    `trained_bytes`: of the Trainer's save of a full fine-tune (4 with fp32 master weights).
    `modules_to_save` (lora.modulesToSave): their trained fp32 copies replace the base's tensors (read
    from the adapter, then cast); with tied embeddings a changed head or embedding is written untied,
    so the folder holds the vocabulary matrix twice."""
    if export == "adapter":
        return None
    out = DTYPE_BYTES[precision]
    compute = out
    qlora = method == "qlora"
    source = stored_bytes if export == "merged" else trained_bytes
    head = arch.vocab_size * arch.hidden_size
    # Tensors the adapter changes: the block linears and the head it adapts, and the modules it
    # replaces with their trained copies.
    adapted: list[int] = []
    plain: list[int] = [head]
    replaced: list[int] = []
    untied = 0
    if export == "merged":
        targets = {shape.name for shape in arch.resolve_lora_targets(lora_targets)}
        for shape in arch.block_linears():
            elements = shape.experts * shape.in_features * shape.out_features
            (adapted if shape.name in targets else plain).append(elements)
        head_adapted = arch.head_adapted(lora_targets)
        if head_adapted:
            adapted.append(head)
        replaced = [head] * len(modules_to_save)
        if arch.tie_word_embeddings and (head_adapted or modules_to_save):
            untied = head * out  # the embedding and the head written apart (export.plan_export)
    else:
        plain += [shape.experts * shape.in_features * shape.out_features for shape in arch.block_linears()]
    working = max([_plain_working_set(n, source, out) for n in plain]
                  + [_merged_working_set(n, source, out, compute, qlora) for n in adapted]
                  + [(FP32 + out) * n for n in replaced])  # the fp32 copy read from the adapter, and its cast
    largest = max(plain + adapted)
    return ExportEstimate(kind=export, host_bytes=int(HOST_PROCESS_BYTES + working + MERGE_OVERHEAD_BYTES),
                          disk_bytes=int(arch.total_params * out + untied), largest_tensor_elements=largest,
                          working_set_bytes=int(working))

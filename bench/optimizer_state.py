"""The optimizer-state term and the step's temporaries against the optimizers themselves, on the CPU.

    python bench/optimizer_state.py [--elements 16777216] [--no-compile]

For each optimizer that runs here (torch's AdamW on its fused and its foreach path, torchao's 8-bit
and 4-bit AdamW) and each weight dtype: one parameter of --elements values (torch's AdamW: a group of
four unequal ones, --elements in all, since foreach works on the whole group at once), two warm-up
steps (torchao compiles its step per shape on the first), then a third step under torch's profiler
with memory profiling. It prints the moments' bytes the optimizer keeps against
`OptimizerKind.state_bytes`, and the bytes the step allocates per value of the group against
`OptimizerKind.step_temp_bytes_per_value` (torchao) or `ADAMW_GROUP_MOMENT_COPIES` x the moment's
bytes (torch's paths). Each allocation is counted once, in the op that made it (an op's figure
includes its callees'); the profiler does not see frees outside ops, so the figure is what the step
allocates, an upper bound of its peak (equal to it for these steps, whose temporaries all live to the
step's end or are one tensor). The temporaries are those of the CPU's kernels (inductor's C++ for
torchao's compiled step): a GPU's kernels may differ, which bench/gpu_levers.py checks on a lent
device. bitsandbytes needs CUDA and is not run here.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "operator"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "images", "trainer"))

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from finetune_trainer import optimizers  # noqa: E402


def tensor_bytes(value) -> int:
    """Storage bytes of an optimizer state value, a tensor subclass's inner tensors included (the
    test of the state term reads it too)."""
    if not isinstance(value, torch.Tensor):
        return 0
    if hasattr(value, "__tensor_flatten__"):
        names, _ = value.__tensor_flatten__()
        return sum(tensor_bytes(getattr(value, name)) for name in names)
    return value.numel() * value.element_size()


def _peak_during(step) -> int:
    """The highest sum of live bytes the CPU allocator's events reach during `step` (from zero). An
    event's figure is its net allocation, its callees' included (`_foreach_sqrt` holds its `sqrt`s'):
    each event counts its own share, what it allocated at its start and what it freed (after its
    callees ran) at its end."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = []
    for e in prof.events():
        own = e.cpu_memory_usage - sum(c.cpu_memory_usage for c in e.cpu_children)
        if own:
            events.append((e.time_range.start if own > 0 else e.time_range.end, own))
    events.sort()
    live = peak = 0
    for _, delta in events:
        live += delta
        peak = max(peak, live)
    return peak


def _class(kind: optimizers.OptimizerKind):
    if kind.library == "torch":
        return torch.optim.AdamW
    module, name = kind.optimizer_class.split(":")
    return getattr(importlib.import_module(module), name)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--elements", type=int, default=16 * 1024 * 1024)
    p.add_argument("--no-compile", action="store_true", help="run torchao's step eagerly (its temporaries differ)")
    ns = p.parse_args()
    if ns.no_compile:
        torch.compile = lambda fn, **_: fn
    rows = []
    # The trainer runs torch's AdamW fused (adamw_torch_fused); foreach is torch's pick on CUDA otherwise.
    runs = [("adamw", {"fused": True}, "fused"), ("adamw", {"foreach": True}, "foreach"),
            ("torchao-adamw-8bit", {}, ""), ("torchao-adamw-4bit", {}, "")]
    for name, path, label in runs:
        kind = optimizers.kind(name)
        for dtype in (torch.float32, torch.bfloat16):
            # torch's AdamW: a group of four unequal tensors (foreach steps a group at once).
            widths = (1, 2, 1, 4) if kind.library == "torch" else (8,)
            params = [torch.nn.Parameter(torch.randn(512, w * ns.elements // 4096, dtype=dtype)) for w in widths]
            for param in params:
                param.grad = torch.randn_like(param)
            optimizer = _class(kind)(params, lr=1e-3, **path)
            start = time.time()
            optimizer.step()
            optimizer.step()
            warm = time.time() - start
            peak = _peak_during(optimizer.step)
            values = sum(p.numel() for p in params)
            kept = sum(tensor_bytes(v) for p in params for k, v in optimizer.state[p].items() if k != "step")
            full = params[0].element_size()
            estimated_temp = (optimizers.ADAMW_GROUP_MOMENT_COPIES[label] * full if label
                              else kind.step_temp_bytes_per_value)
            rows.append((f"{name} {label}".strip(), str(dtype).removeprefix("torch."), kept,
                         sum(kind.state_bytes(p.numel(), full) for p in params), peak / values, estimated_temp, warm))
    print(f"{'optimizer':<20} {'weights':<9} {'state kept':>12} {'estimated':>12} {'step temp B/value':>18} "
          f"{'estimated':>9} {'warm-up s':>9}")
    for name, dtype, kept, est, temp, est_temp, warm in rows:
        print(f"{name:<20} {dtype:<9} {kept:>12,} {est:>12,.0f} {temp:>18.2f} {est_temp:>9.2f} {warm:>9.0f}")


if __name__ == "__main__":
    main()

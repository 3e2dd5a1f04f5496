"""The optimizer-state term and the step's temporaries against the optimizers themselves, on the CPU.

    python bench/optimizer_state.py [--elements 16777216] [--no-compile]

For each optimizer that runs here (torch's AdamW, torchao's 8-bit and 4-bit AdamW) and each
weight dtype: one parameter of --elements values, two warm-up steps (torchao compiles its step
per shape on the first), then a third step under torch's profiler with memory profiling. It prints
the moments' bytes the optimizer keeps against `OptimizerKind.state_bytes`, and the step's peak
transient bytes per value against `OptimizerKind.step_temp_bytes_per_value`. The temporaries are
those of the CPU's compiled kernels (inductor's C++): a GPU's Triton kernels may fuse otherwise,
which bench/gpu_levers.py checks on a lent device. bitsandbytes needs CUDA and is not run here.
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
    """The highest sum of live bytes the CPU allocator's events reach during `step` (from zero)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = sorted((e.time_range.start, e.cpu_memory_usage) for e in prof.events() if e.cpu_memory_usage)
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
    for name in ("adamw", "torchao-adamw-8bit", "torchao-adamw-4bit"):
        kind = optimizers.kind(name)
        for dtype in (torch.float32, torch.bfloat16):
            param = torch.nn.Parameter(torch.randn(4096, ns.elements // 4096, dtype=dtype))
            param.grad = torch.randn_like(param)
            # The trainer runs torch's AdamW fused (adamw_torch_fused).
            optimizer = _class(kind)([param], lr=1e-3, **({"fused": True} if kind.library == "torch" else {}))
            start = time.time()
            optimizer.step()
            optimizer.step()
            warm = time.time() - start
            peak = _peak_during(optimizer.step)
            kept = sum(tensor_bytes(v) for k, v in optimizer.state[param].items() if k != "step")
            full = param.element_size()
            rows.append((name, str(dtype).removeprefix("torch."), kept, kind.state_bytes(param.numel(), full),
                         peak / param.numel(), kind.step_temp_bytes_per_value, warm))
    print(f"{'optimizer':<20} {'weights':<9} {'state kept':>12} {'estimated':>12} {'step temp B/value':>18} "
          f"{'estimated':>9} {'warm-up s':>9}")
    for name, dtype, kept, est, temp, est_temp, warm in rows:
        print(f"{name:<20} {dtype:<9} {kept:>12,} {est:>12,.0f} {temp:>18.2f} {est_temp:>9.2f} {warm:>9.0f}")


if __name__ == "__main__":
    main()

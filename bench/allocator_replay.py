"""Reserved over allocated, from real allocation traces: each setup's training steps are traced
on the CPU with fake tensors (the pre-flight profile's code, as bench/sizing_truth.py), the
tracker recording every storage's allocation and free in order
(finetune_trainer.peak_tracker.PeakTracker(record=True)); the trace is replayed through the
caching-allocator model (finetune_operator.sizing.allocator) with expandable segments off and on.

Fixed-length runs repeat one sequence length; variable-length runs change it every step, as
the trainer's collator does (it pads each micro-batch to its longest example; no packing).
The factor reported is peak reserved over the trace's live peak (the tracker's peak, which
the estimator models); `min cap` is the least device memory the trace runs in, the allocator
giving cached memory back when it must (allocator.min_capacity).

Not traced here (the profile cannot): QLoRA (bitsandbytes needs CUDA), CPU offload, other streams
(NCCL's), CUDA graphs.

    python bench/allocator_replay.py            # the table; writes bench/results/allocator_replay.json
    python bench/allocator_replay.py --only lora --no-write
    python bench/allocator_replay.py --from-json   # the table and the fit from the stored results
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "operator"))
sys.path.insert(0, os.path.join(HERE, "..", "images", "trainer"))
sys.path.insert(0, HERE)

from finetune_operator.sizing import TrainingSetup, estimate_memory  # noqa: E402
from finetune_operator.sizing.allocator import (  # noqa: E402
    FACTOR_MARGIN, MIN_CAPACITY_FACTORS, TRANSIENT_FACTORS, factor_key, fit_factors, min_capacity, replay,
    resident_bytes)
from finetune_operator.sizing.presets import preset  # noqa: E402

GIB = 1 << 30
RESULTS = os.path.join(HERE, "results", "allocator_replay.json")


@dataclass(frozen=True)
class ReplayCase:
    name: str
    preset: str
    method: str
    seqs: tuple[int, ...]  # one sequence length per traced step
    batch: int = 1
    gc: bool = False
    layers: int = 0  # 0: the preset's own
    strategy: str = "ddp"
    world_size: int = 1
    dropout: float = 0.0
    held_out: bool = False  # not used to fit the factors

    @property
    def variable(self) -> bool:
        return len(set(self.seqs)) > 1

    def setup(self) -> TrainingSetup:
        arch = preset(self.preset)
        if self.layers:
            arch = arch.with_layers(self.layers)
        return TrainingSetup(architecture=arch, method=self.method, lora_dropout=self.dropout,
                             micro_batch_size=self.batch, sequence_length=max(self.seqs),
                             gradient_checkpointing=self.gc, strategy=self.strategy, world_size=self.world_size)


def _var(s: int) -> tuple[int, ...]:
    # Uneven and not sorted: a short batch, a longer one, the longest, one in between.
    return (s // 2, 3 * s // 4, s, 5 * s // 8)


def _fix(s: int) -> tuple[int, ...]:
    return (s, s, s)


CASES = [
    ReplayCase("1b-full-fixed", "llama-3.2-1b", "full", _fix(1024), batch=2),
    ReplayCase("1b-full-var", "llama-3.2-1b", "full", _var(1024), batch=2),
    ReplayCase("1b-full-gc-fixed", "llama-3.2-1b", "full", _fix(2048), batch=2, gc=True),
    ReplayCase("1b-full-gc-var", "llama-3.2-1b", "full", _var(2048), batch=2, gc=True),
    ReplayCase("1b-lora-fixed", "llama-3.2-1b", "lora", _fix(2048), batch=2),
    ReplayCase("1b-lora-var", "llama-3.2-1b", "lora", _var(2048), batch=2),
    ReplayCase("1b-lora-gc-fixed", "llama-3.2-1b", "lora", _fix(4096), batch=2, gc=True),
    ReplayCase("1b-lora-gc-var", "llama-3.2-1b", "lora", _var(4096), batch=2, gc=True),
    # Held out: other models, dropout, FSDP (resize_-driven all-gathers), longer sequences.
    ReplayCase("qwen0.5b-full-var", "qwen2.5-0.5b", "full", _var(1024), batch=4, held_out=True),
    ReplayCase("qwen0.5b-lora-drop-fixed", "qwen2.5-0.5b", "lora", _fix(2048), batch=2, dropout=0.05, held_out=True),
    ReplayCase("3b-lora-gc-var", "llama-3.2-3b", "lora", _var(4096), gc=True, layers=8, held_out=True),
    ReplayCase("3b-full-gc-fixed", "llama-3.2-3b", "full", _fix(2048), gc=True, layers=8, held_out=True),
    ReplayCase("1b-full-fsdp2-var", "llama-3.2-1b", "full", _var(1024), batch=2, strategy="fsdp", world_size=2,
               held_out=True),
    ReplayCase("1b-lora-fsdp2-gc-fixed", "llama-3.2-1b", "lora", _fix(2048), batch=2, gc=True, strategy="fsdp",
               world_size=2, held_out=True),
]


@dataclass
class ReplayRow:
    case: dict
    events: int
    peak_live: int  # the trace's live peak (the tracker's, 512-rounded)
    classic: dict = field(default_factory=dict)  # AllocatorStats of the replay
    expandable: dict = field(default_factory=dict)
    min_cap_classic: int = 0
    min_cap_expandable: int = 0
    trace_s: float = 0.0
    replay_s: float = 0.0


def trace(case: ReplayCase) -> list[tuple[int, int | None]]:
    """The ordered alloc/free trace of `len(case.seqs)` training steps (the profile's step:
    accelerate-like autocast forward, loss, backward, clipping, fused AdamW, zero_grad)."""
    import torch
    import torch.distributed.tensor._sharding_prop as sharding_prop
    from torch._subclasses.fake_tensor import FakeTensorMode

    from finetune_trainer import profile
    from finetune_trainer.peak_tracker import PeakTracker
    from sizing_truth import profile_setup

    setup = case.setup()
    psetup = profile_setup(setup)
    sharded = setup.strategy == "fsdp"
    mesh = None
    if sharded:
        profile._init_fake_world(setup.world_size)
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (setup.world_size,))
    model = profile.build_meta_model(profile.hf_config(setup.architecture.to_hf_config()), psetup)
    tied = profile._is_tied(profile._base(model))
    if sharded:
        profile._apply_fsdp(model, mesh)
    own_mode = FakeTensorMode(allow_non_fake_inputs=True)
    orig_detect = sharding_prop.detect_fake_mode
    sharding_prop.detect_fake_mode = lambda *a: own_mode
    tracker = PeakTracker(record=True)
    try:
        with profile._patched_transformers(), FakeTensorMode(allow_non_fake_inputs=True), tracker:
            model.to_empty(device="cpu")
            if not sharded and tied:
                model.tie_weights()
            params = [p for p in model.parameters() if p.requires_grad]
            optimizer = torch.optim.AdamW(params, lr=1e-4, fused=True)
            forward = profile._wrap_forward_like_accelerate(model, setup.precision)
            for s in case.seqs:
                input_ids = torch.zeros((case.batch, s), dtype=torch.long)
                labels = torch.zeros((case.batch, s), dtype=torch.long)
                loss = forward(input_ids=input_ids, labels=labels).loss
                loss.backward()
                del loss
                torch.nn.utils.clip_grad_norm_(params, 1.0)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                del input_ids, labels
    finally:
        sharding_prop.detect_fake_mode = orig_detect
        if sharded:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
    return tracker.events


def run_case(case: ReplayCase, with_min_cap: bool = True) -> ReplayRow:
    t0 = time.perf_counter()
    events = trace(case)
    t1 = time.perf_counter()
    classic = replay(events, expandable=False)
    expandable = replay(events, expandable=True)
    row = ReplayRow(case=asdict(case), events=len(events), peak_live=classic.peak_requested,
                    classic=asdict(classic), expandable=asdict(expandable), trace_s=t1 - t0)
    if with_min_cap:
        row.min_cap_classic = min_capacity(events, expandable=False)
        row.min_cap_expandable = min_capacity(events, expandable=True)
    row.replay_s = time.perf_counter() - t1
    return row


HEADER = (f"{'setup':<26} {'held':>4} {'live GiB':>8} {'alloc GiB':>9} {'classic GiB':>11} {'ratio':>6} "
          f"{'expand GiB':>10} {'ratio':>6} {'min cap c/e':>11}")


def format_row(r: ReplayRow) -> str:
    live = r.peak_live
    c, e = r.classic["peak_reserved"], r.expandable["peak_reserved"]
    caps = f"{r.min_cap_classic / live:.3f}/{r.min_cap_expandable / live:.3f}" if r.min_cap_classic else "-"
    return (f"{r.case['name']:<26} {'yes' if r.case['held_out'] else 'no':>4} {live / GIB:8.2f} "
            f"{r.classic['peak_allocated'] / GIB:9.2f} {c / GIB:11.2f} {c / live:6.3f} {e / GIB:10.2f} {e / live:6.3f} "
            f"{caps:>11}")


def factor_rows(rows: list[dict], held_out: bool, measure: str = "reserved"):
    """(FactorKey, ratio, name, mode) for both allocator modes of each row that is (or is not) held out.
    measure "reserved": the unlimited run's peak reserved (what max_memory_reserved shows on a GPU
    with room to spare) over the transient part, resident (allocator.resident_bytes of the memory
    model's estimate of the case) set aside: (reserved - resident) / (live peak - resident);
    "min_cap": the least capacity the trace runs in (what decides a fit) over the live peak."""
    by_name = {c.name: c for c in CASES}
    for r in rows:
        case = r["case"]
        if case["held_out"] != held_out:
            continue
        variable = len(set(case["seqs"])) > 1
        resident = resident_bytes(estimate_memory(by_name[case["name"]].setup())) if measure == "reserved" else 0.0
        for mode, expandable in (("classic", False), ("expandable", True)):
            top = r[mode]["peak_reserved"] if measure == "reserved" else r[f"min_cap_{mode}"]
            yield (factor_key(expandable, variable, case["gc"]), (top - resident) / (r["peak_live"] - resident),
                   case["name"], mode)


def print_fit(rows: list[dict]) -> None:
    for measure, stored_factors in (("reserved", TRANSIENT_FACTORS), ("min_cap", MIN_CAPACITY_FACTORS)):
        _print_fit(rows, measure, stored_factors)


def _print_fit(rows: list[dict], measure: str, stored_factors: dict) -> None:
    fit = fit_factors((k, v) for k, v, _, _ in factor_rows(rows, held_out=False, measure=measure))
    name_of = "TRANSIENT_FACTORS" if measure == "reserved" else "MIN_CAPACITY_FACTORS"
    what = ("(reserved - resident) / (live peak - resident)" if measure == "reserved"
            else "least capacity / live peak")
    print(f"\n{measure}, {what}: fit on the rows not held out (the largest ratio of each group, rounded up to 0.01):")
    for key, value in sorted(fit.items(), key=lambda kv: (not kv[0].expandable, kv[0].variable, kv[0].checkpointing)):
        stored = stored_factors.get(key)
        print(f"  expandable={key.expandable!s:<5} variable={key.variable!s:<5} checkpointing={key.checkpointing!s:<5}"
              f" fit {value:.2f}  ({name_of} {stored})")
    print(f"held out: measured ratio vs the fit (and with FACTOR_MARGIN {FACTOR_MARGIN}); negative = under-predicted")
    worst = 0.0
    for key, ratio, name, mode in factor_rows(rows, held_out=True, measure=measure):
        gap = fit[key] - ratio
        worst = min(worst, gap)
        print(f"  {name:<26} {mode:<10} measured {ratio:.3f}  fit {fit[key]:.2f} ({gap:+.3f})  "
              f"with margin {fit[key] + FACTOR_MARGIN:.2f} ({gap + FACTOR_MARGIN:+.3f})")
    print(f"held-out worst under-prediction without the margin: {worst:+.3f}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default="", help="run the cases whose name contains this")
    ap.add_argument("--no-min-cap", action="store_true", help="skip the bisection for the least capacity")
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--out", default=RESULTS)
    ap.add_argument("--from-json", action="store_true", help="print the table and the fit from --out, trace nothing")
    ns = ap.parse_args(argv)
    if ns.from_json:
        with open(ns.out) as f:
            stored = json.load(f)["rows"]
        print(HEADER)
        for r in stored:
            print(format_row(ReplayRow(**r)))
        print_fit(stored)
        return 0
    rows = []
    print(HEADER, flush=True)
    for case in [c for c in CASES if ns.only in c.name]:
        row = run_case(case, with_min_cap=not ns.no_min_cap)
        rows.append(row)
        print(format_row(row) + f"   ({row.events} events, trace {row.trace_s:.0f}s, replay {row.replay_s:.0f}s)",
              flush=True)
    print("ratio: peak reserved / the trace's live peak (what the estimator models); "
          "min cap: least device memory the trace runs in / live peak, classic/expandable")
    if not ns.no_write:
        import torch

        os.makedirs(os.path.dirname(ns.out), exist_ok=True)
        with open(ns.out, "w") as f:
            json.dump({"torch": torch.__version__, "rows": [asdict(r) for r in rows]}, f, indent=1)
        print(f"results: {ns.out}")
    print_fit([asdict(r) for r in rows])
    return 0


if __name__ == "__main__":
    sys.exit(main())

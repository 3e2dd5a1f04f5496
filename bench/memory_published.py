"""The memory model against published, measured peak GPU memory of fine-tuning runs (issue 28).

For each row of bench/memory_published_rows.py (torchtune's README and tutorials, Answer.AI's fsdp_qlora
benchmarks, Lit-GPT's resource tables) the published setup is built as a `TrainingSetup`, estimated with
`estimate_memory`, and the estimate is put in the row's metric:

- allocated / active: the estimate's `peak_allocated_bytes` (what torch.cuda.max_memory_allocated reports;
  torchtune's active peak is the same figure but for blocks a side stream still uses);
- reserved: `allocator.reserved_bytes(estimate, setup, expandable_segments=..., variable_lengths=...)` (the
  resident part as it is, the transient rest x its replayed factor), as bench/recipes.py does: the row says whether the run used expandable segments (none of them did:
  fsdp_qlora and Lit-GPT never set PYTORCH_CUDA_ALLOC_CONF, torchtune only from 2025-06) and whether every
  micro-batch had the same length (packed or fixed-length dummy data) or not (padded alpaca);
- nvidia-smi: that reserved figure + `CUDA_CONTEXT_GIB` (0.5 GiB: the CUDA context and cuBLAS workspace
  a training process holds outside the caching allocator, the order of what a CUDA 12 context takes).

The error is predicted / published - 1. The summary gives, per metric and per split, the count, the median
absolute error and the worst under- and over-prediction, and whether issue 28's goal holds on the
allocated/active rows: median |err| <= 5% and no row more than 5% under. A row whose setup raises a
SizingError is listed as left out with the message.

Usage:
    python bench/memory_published.py              # every row, then the summary
    python bench/memory_published.py --why        # also each row's setup differences and source
    python bench/memory_published.py --json       # machine output
    python bench/memory_published.py --split held-out
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for _path in (ROOT / "operator", ROOT / "images" / "trainer", ROOT / "bench"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from finetune_operator.sizing import PRESETS, ModelArchitecture, TrainingSetup, estimate_memory  # noqa: E402
from finetune_operator.sizing.allocator import reserved_bytes  # noqa: E402
from finetune_operator.sizing.errors import SizingError  # noqa: E402
from memory_published_rows import ROWS, Row  # noqa: E402

GIB = 1 << 30
CUDA_CONTEXT_GIB = 0.5
GOAL_MEDIAN = 0.05
GOAL_UNDER = -0.05
GOAL_METRICS = ("allocated", "active")


@dataclass(frozen=True)
class Result:
    row: Row
    predicted_gib: float | None  # in the row's metric; None when left out
    peak_allocated_gib: float | None = None
    factor: float | None = None  # reserved over allocated, for reserved and nvidia-smi rows
    peak_phase: str | None = None
    left_out: str | None = None

    @property
    def error(self) -> float | None:
        return None if self.predicted_gib is None else self.predicted_gib / self.row.published_gib - 1


def architecture(row: Row) -> ModelArchitecture:
    if isinstance(row.model, str):
        return PRESETS[row.model]
    return ModelArchitecture.from_hf_config(row.model, name=row.model_name)


def setup_of(row: Row) -> TrainingSetup:
    return TrainingSetup(
        architecture=architecture(row), method=row.method, lora_rank=row.lora_rank, lora_targets=row.lora_targets,
        lora_dropout=row.lora_dropout, precision=row.precision, optimizer=row.optimizer,
        micro_batch_size=row.micro_batch, sequence_length=row.sequence_length,
        gradient_checkpointing=row.gradient_checkpointing, strategy=row.strategy, world_size=row.gpus,
        offload=row.offload, gradient_accumulation=row.accumulation, **row.levers,
    )


def predict(row: Row) -> Result:
    if row.not_expressible:
        return Result(row, None, left_out=row.not_expressible)
    try:
        setup = setup_of(row)
        estimate = estimate_memory(setup)
    except (SizingError, KeyError) as exc:
        return Result(row, None, left_out=f"{type(exc).__name__}: {exc}")
    peak = estimate.peak_allocated_bytes / GIB
    if row.metric in ("allocated", "active"):
        return Result(row, peak, peak, None, estimate.peak_phase)
    reserved = reserved_bytes(estimate, setup, expandable_segments=row.expandable_segments,
                              variable_lengths=not row.fixed_lengths) / GIB
    factor = reserved / peak  # reserved over allocated, as printed
    value = reserved + (CUDA_CONTEXT_GIB if row.metric == "nvidia-smi" else 0.0)
    return Result(row, value, peak, factor, estimate.peak_phase)


def evaluate(rows: list[Row] = ROWS) -> list[Result]:
    return [predict(row) for row in rows]


def stats(results: list[Result]) -> dict | None:
    errors = [(r.error, r.row.key) for r in results if r.error is not None]
    if not errors:
        return None
    under, over = min(errors), max(errors)
    return {"count": len(errors), "median_abs_error": statistics.median(abs(e) for e, _ in errors),
            "worst_under": under[0], "worst_under_row": under[1], "worst_over": over[0], "worst_over_row": over[1]}


def goal(results: list[Result], metrics: tuple[str, ...] = GOAL_METRICS) -> dict | None:
    """Issue 28's goal on the rows of `results` in `metrics` (allocated and active by default)."""
    s = stats([r for r in results if r.row.metric in metrics])
    if s is None:
        return None
    return dict(s, holds=s["median_abs_error"] <= GOAL_MEDIAN and s["worst_under"] >= GOAL_UNDER)


def _line(s: dict) -> str:
    return (f"{s['count']} rows: median |err| {s['median_abs_error']:.1%}, worst under {s['worst_under']:+.1%} "
            f"({s['worst_under_row']}), worst over {s['worst_over']:+.1%} ({s['worst_over_row']})")


def summary_lines(results: list[Result]) -> list[str]:
    lines = []
    splits = [s for s in ("in-sample", "held-out") if any(r.row.split == s for r in results)]
    for metric in ("allocated", "active", "reserved", "nvidia-smi"):
        for split in splits:
            s = stats([r for r in results if r.row.metric == metric and r.row.split == split])
            if s:
                lines.append(f"{metric:9} {split:9}: {_line(s)}")
    for split in splits:
        chosen = [r for r in results if r.row.split == split]
        g = goal(chosen)
        if g:
            lines.append(f"goal ({'/'.join(GOAL_METRICS)}, {split}): {_line(g)} -> "
                         f"{'HOLDS' if g['holds'] else 'does NOT hold'} (median <= {GOAL_MEDIAN:.0%}, "
                         f"none below {GOAL_UNDER:+.0%})")
        eager = goal([r for r in chosen if not r.row.compiled])
        if eager:
            lines.append(f"  of which eager runs only: {_line(eager)}")
        allocated = goal(chosen, ("allocated",))
        if allocated:
            lines.append(f"  allocated alone (the goal's own metric): {_line(allocated)} -> "
                         f"{'HOLDS' if allocated['holds'] else 'does NOT hold'}")
    return lines


def to_json(results: list[Result]) -> dict:
    rows = []
    for r in results:
        row = r.row
        rows.append({
            "key": row.key, "split": row.split, "source": row.source, "model": row.model_name, "method": row.method,
            "gpu": row.gpu, "gpus": row.gpus, "strategy": row.strategy, "micro_batch": row.micro_batch,
            "sequence_length": row.sequence_length, "gradient_checkpointing": row.gradient_checkpointing,
            "metric": row.metric, "published_gib": row.published_gib, "published": row.published,
            "predicted_gib": r.predicted_gib, "peak_allocated_gib": r.peak_allocated_gib,
            "reserved_factor": r.factor, "peak_phase": r.peak_phase, "error": r.error, "compiled": row.compiled,
            "left_out": r.left_out, "differences": row.differences,
        })
    by = {}
    for metric in ("allocated", "active", "reserved", "nvidia-smi"):
        for split in ("in-sample", "held-out"):
            s = stats([r for r in results if r.row.metric == metric and r.row.split == split])
            if s:
                by[f"{metric}/{split}"] = s
    goals = {split: goal([r for r in results if r.row.split == split]) for split in ("in-sample", "held-out")}
    return {"rows": rows, "summary": by, "goal": {k: v for k, v in goals.items() if v}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--split", choices=["in-sample", "held-out", "all"], default="all")
    parser.add_argument("--why", action="store_true", help="print each row's setup differences and source")
    parser.add_argument("--json", action="store_true", help="machine output")
    args = parser.parse_args(argv)
    results = evaluate([r for r in ROWS if args.split in ("all", r.split)])
    if args.json:
        print(json.dumps(to_json(results), indent=2))
        return 0
    print("Predicted vs published peak GPU memory per GPU, GiB. metric: what the figure counts (allocated, active, "
          "reserved, nvidia-smi); predicted: the estimate in that metric (reserved: peak allocated x the classic "
          "allocator's reserved factor, shown as xF); 'c' = measured with torch.compile")
    header = (f"{'row':38} {'split':8} {'model':15} {'method':6} {'GPUs':>16} {'strategy':8} {'mb':>3} {'seq':>6} "
              f"{'ckpt':4} {'metric':9} {'published':>9} {'predicted':>9} {'factor':>6} {'error':>7}")
    print(header)
    print("-" * len(header))
    for r in results:
        row = r.row
        gpus = f"{row.gpus}x{row.gpu}"
        published = f"{row.published_gib:.2f}" + ("c" if row.compiled else " ")
        predicted = "-" if r.predicted_gib is None else f"{r.predicted_gib:.2f}"
        factor = f"x{r.factor:.2f}" if r.factor else ""
        error = "left out" if r.error is None else f"{r.error:+.1%}"
        print(f"{row.key:38} {row.split:8} {row.model_name:15} {row.method:6} {gpus:>16} {row.strategy:8} "
              f"{row.micro_batch:>3} {row.sequence_length:>6} {'on' if row.gradient_checkpointing else 'off':4} "
              f"{row.metric:9} {published:>9} {predicted:>9} {factor:>6} {error:>7}")
        if args.why:
            print(f"    published: {row.published}")
            if r.peak_allocated_gib is not None and r.factor:
                print(f"    peak allocated {r.peak_allocated_gib:.2f} GiB ({r.peak_phase}); expandable segments "
                      f"{'on' if row.expandable_segments else 'off'}, "
                      f"{'fixed' if row.fixed_lengths else 'variable'} lengths")
            if row.differences:
                print(f"    differences: {row.differences.lstrip('; ')}")
            print(f"    source: {row.source}")
    print()
    for line in summary_lines(results):
        print(line)
    left_out = [r for r in results if r.left_out]
    if left_out:
        print(f"\nLeft out ({len(left_out)}: not expressible in the model, or the estimate raised):")
        for r in left_out:
            print(f"  {r.row.key}: {r.left_out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

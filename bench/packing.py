"""Packing with boundaries: ours (finetune_trainer.data.pack) against TRL's `pack_dataset(strategy="bfd")`.

Both are best fit in decreasing length with over-long examples truncated. The table compares, on
synthetic token-length distributions (seeded), how full the packed sequences are (real tokens over
sequences x sequenceLength: the share of each step's compute that is real data), how many
sequences result, and the time to pack. TRL packs per `datasets.map` batch (1000 examples by
default), ours over the whole dataset at once; `--trl-batch` sets TRL's batch.

    python bench/packing.py                 # ours only (TRL not installed)
    /path/to/venv/with/trl/bin/python bench/packing.py

TRL needs `trl` and `datasets` (with pyarrow), which the trainer image does not carry.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "images", "trainer"))

from finetune_trainer.data import Example, pack  # noqa: E402

DISTRIBUTIONS = {
    # name: (median tokens, spread): lognormal lengths, as chat and instruction data are.
    "short chat (median 300)": (300, 0.8),
    "instructions (median 800)": (800, 0.7),
    "long documents (median 3000)": (3000, 0.6),
}


def lengths(median: int, sigma: float, n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [max(1, int(rng.lognormvariate(0, sigma) * median)) for _ in range(n)]


def ours(sizes: list[int], seq: int) -> tuple[int, int, float]:
    examples = [Example(list(range(n)), list(range(n))) for n in sizes]
    t0 = time.perf_counter()
    packed = pack(examples, seq)
    return len(packed), sum(len(e.input_ids) for e in packed), time.perf_counter() - t0


def trl(sizes: list[int], seq: int, batch: int) -> tuple[int, int, float] | None:
    try:
        from datasets import Dataset, disable_progress_bars
        from trl import pack_dataset
    except ImportError:
        return None
    disable_progress_bars()
    dataset = Dataset.from_dict({"input_ids": [list(range(n)) for n in sizes]})
    t0 = time.perf_counter()
    packed = pack_dataset(dataset, seq, strategy="bfd", map_kwargs={"batch_size": batch})
    tokens = sum(len(row) for row in packed["input_ids"])
    return len(packed), tokens, time.perf_counter() - t0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--examples", type=int, default=20000)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--trl-batch", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    ns = ap.parse_args(argv)
    head = f"{'distribution':<30} {'packer':<16} {'sequences':>9} {'fill':>7} {'seconds':>8}"
    print(head)
    print("-" * len(head))
    for name, (median, sigma) in DISTRIBUTIONS.items():
        sizes = lengths(median, sigma, ns.examples, ns.seed)
        rows = [("ours (global)", ours(sizes, ns.seq)), (f"TRL bfd ({ns.trl_batch})", trl(sizes, ns.seq, ns.trl_batch))]
        for packer, result in rows:
            if result is None:
                print(f"{name:<30} {packer:<16} {'(trl and datasets not installed)':>26}")
                continue
            count, tokens, seconds = result
            print(f"{name:<30} {packer:<16} {count:>9} {tokens / (count * ns.seq):>6.1%} {seconds:>8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

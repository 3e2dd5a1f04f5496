"""What spec.dataset.paddingFree and spec.dataset.microBatchTokens save, on synthetic token-length
distributions (seeded lognormal, as chat and instruction data are; bench/packing.py's).

For each distribution and micro-batch b, one epoch in the trainer's sample order (seed 42), the tokens
of the largest micro-batch the planner sizes and the estimated peak (Llama 3.1 8B, LoRA, flash
attention, gradient checkpointing, one GPU):

- `undeclared`: padded, any example may be sequenceLength long (b x sequenceLength);
- `declared`: padded to the longest example (b x microBatchTokens[0]);
- `padding-free`: one row of real tokens, sized by microBatchTokens[b-1], the most any b consecutive
  samples of the run hold (data.stream_window_tokens, what dataset_stats prints);
- `b longest`: the b longest examples together, the bound without the sample order;
- `run's worst`: the largest micro-batch the run really makes (windows starting at multiples of b);
- `mean`: the real tokens of an average micro-batch, which is what compute scales with.

    python bench/padding_free.py [--examples 20000] [--sequence-length 4096]
"""

from __future__ import annotations

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "images", "trainer"))
sys.path.insert(0, os.path.join(HERE, "..", "operator"))
sys.path.insert(0, HERE)

from finetune_operator.sizing import TrainingSetup, estimate_memory  # noqa: E402
from finetune_operator.sizing.presets import preset  # noqa: E402
from finetune_trainer.data import sample_order, window_tokens  # noqa: E402
from packing import DISTRIBUTIONS, lengths  # noqa: E402

GIB = 1 << 30


def peak(arch, micro: int, seq: int, **kw) -> float:
    setup = TrainingSetup(architecture=arch, method="lora", attention="flash", gradient_checkpointing=True,
                          micro_batch_size=micro, sequence_length=seq, **kw)
    return estimate_memory(setup).peak_allocated_bytes / GIB


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--examples", type=int, default=20000)
    ap.add_argument("--sequence-length", type=int, default=4096)
    ap.add_argument("--micro", default="4,8,16")
    args = ap.parse_args(argv)
    arch, seq = preset("llama-3.1-8b"), args.sequence_length
    print(f"llama-3.1-8b LoRA r16, flash, checkpointing; sequenceLength {seq}; {args.examples} examples; "
          "tokens of the largest micro-batch / estimated peak GiB")
    header = (f"{'distribution':<30} {'b':>3} {'undeclared':>17} {'declared':>17} {'padding-free':>17} "
              f"{'b longest':>10} {'run worst':>10} {'mean':>7} {'saved':>6}")
    print(header)
    print("-" * len(header))
    micros = [int(m) for m in args.micro.split(",")]
    for name, (median, sigma) in DISTRIBUTIONS.items():
        cut = [min(seq, n) for n in lengths(median, sigma, args.examples, seed=1)]
        stream = [cut[i] for i in sample_order(len(cut), 0, len(cut), seed=42)]
        declared = tuple(window_tokens(stream, max(micros)))
        longest = sorted(cut, reverse=True)
        for micro in micros:
            batches = [sum(stream[k:k + micro]) for k in range(0, len(stream) - micro + 1, micro)]
            undeclared = peak(arch, micro, seq)
            padded = peak(arch, micro, seq, micro_batch_tokens=declared)
            free = peak(arch, micro, seq, padding_free=True, micro_batch_tokens=declared)
            print(f"{name:<30} {micro:>3} {micro * seq:>7} {undeclared:>5.1f} GiB {micro * declared[0]:>7} "
                  f"{padded:>5.1f} GiB {declared[micro - 1]:>7} {free:>5.1f} GiB {sum(longest[:micro]):>10} "
                  f"{max(batches):>10} {sum(batches) / len(batches):>7.0f} {1 - free / undeclared:>6.0%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

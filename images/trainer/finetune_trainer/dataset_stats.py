"""What a job's data holds, as the trainer builds and orders it: the `spec.dataset.microBatchTokens`
that lets the planner size micro-batches by the data instead of by `sequenceLength`.

    python -m finetune_trainer.dataset_stats data.jsonl --tokenizer DIR --global-batch-size 64 --epochs 1 \
        [--format chat] [--sequence-length 2048] [--seed 42] [--held-out-fraction 0.05] [--count 64]

The flags are the job's fields of the same names (their defaults are the API's). It prints one JSON
object: the examples, the samples the run trains on, token-length percentiles, and `microBatchTokens`:
for b = 1 .. count, the most tokens any b consecutive samples of the run's order hold. The trainer
computes the same with the same code (data.stream_window_tokens) before it loads the model, so the
values pass its check on the same data and tokenizer; another seed, batch, step count or held-out
fraction orders the samples differently and needs its own values.
"""

from __future__ import annotations

import argparse
import json
import math
import sys

from .contract import MICRO_BATCH_TOKENS_COUNT
from .data import build_examples, held_out_split, read_jsonl, stream_window_tokens, total_samples
from .errors import DataError

# The FineTuneJob API's defaults (tests/trainer/test_trainer_data.py checks they agree).
DEFAULT_FORMAT = "chat"
DEFAULT_SEQUENCE_LENGTH = 2048
DEFAULT_SEED = 42


def percentiles(lengths: list[int]) -> dict[str, int]:
    """p50, p90, p99 (nearest rank) and the longest of token lengths."""
    ascending = sorted(lengths)
    n = len(ascending)

    def at(p: float) -> int:
        return ascending[min(n - 1, max(0, math.ceil(p * n / 100) - 1))]

    return {"p50": at(50), "p90": at(90), "p99": at(99), "max": ascending[-1]}


def run_samples(num_examples: int, global_batch_size: int, max_steps: int | None, epochs: float | None) -> int:
    """The samples a run trains on: whole steps of the global batch (data.total_samples for epochs,
    rounded up to a step, as the trainer's plan_run does)."""
    steps = max_steps if max_steps is not None else math.ceil(total_samples(num_examples, epochs) / global_batch_size)
    return steps * global_batch_size


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m finetune_trainer.dataset_stats",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("path", help="a JSONL file or a directory of *.jsonl files (the job's spec.dataset data)")
    parser.add_argument("--tokenizer", required=True, help="a local directory with the model's tokenizer")
    parser.add_argument("--format", choices=("chat", "instruction", "text"), default=DEFAULT_FORMAT)
    parser.add_argument("--sequence-length", type=int, default=DEFAULT_SEQUENCE_LENGTH)
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED, help="spec.training.seed")
    parser.add_argument("--global-batch-size", type=int, required=True)
    steps = parser.add_mutually_exclusive_group(required=True)
    steps.add_argument("--max-steps", type=int)
    steps.add_argument("--epochs", type=float)
    parser.add_argument("--held-out-fraction", type=float, help="spec.evaluation.heldOutFraction, if set")
    parser.add_argument("--count", type=int, default=MICRO_BATCH_TOKENS_COUNT, help="how many values to print (1-64)")
    args = parser.parse_args(argv)
    if not 1 <= args.count <= MICRO_BATCH_TOKENS_COUNT:
        parser.error("--count must be 1-64 (spec.dataset.microBatchTokens holds at most 64)")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer, local_files_only=True)
    try:
        examples = build_examples(tokenizer, read_jsonl(args.path), args.format, args.sequence_length, packing=False)
        if args.held_out_fraction is not None:
            examples, _ = held_out_split(examples, args.held_out_fraction, args.seed)
    except DataError as error:
        print(f"error: {error}", file=sys.stderr)
        return 65
    samples = run_samples(len(examples), args.global_batch_size, args.max_steps, args.epochs)
    found = {"examples": len(examples), "samples": samples, **percentiles([len(e.input_ids) for e in examples]),
             "microBatchTokens": stream_window_tokens(examples, args.seed, samples, args.count)}
    print(json.dumps(found))
    return 0


if __name__ == "__main__":
    sys.exit(main())

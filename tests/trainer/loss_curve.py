"""Print the loss curve of a CPU run of the trainer on the tiny Llama.

    python tests/trainer/loss_curve.py [--method full|lora] [--steps 30] [--nproc 1]

Builds the tiny model, tokenizer and chat dataset in a temporary folder, runs the
trainer as a pod would, and prints one line per step plus the summary.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainer.conftest import run_trainer, trainer_config, write_config  # noqa: E402
from trainer.trainer_assets import build_assets  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--method", choices=["full", "lora"], default="full")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--nproc", type=int, default=1)
    parser.add_argument("--strategy", default="ddp", choices=["ddp", "fsdp"])
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        assets = build_assets(work / "assets")
        extra = {"lora": {"rank": 8, "alpha": 16, "dropout": 0.0}, "learningRate": 1e-2} if args.method == "lora" else {}
        config = trainer_config(assets, work, method=args.method, maxSteps=args.steps, strategy=args.strategy,
                                microBatchSize=4 // args.nproc or 1, checkpoint=None, **extra)
        run = run_trainer(write_config(work, config), nproc=args.nproc, timeout=1800)
        if run.returncode != 0:
            print(run.output[-4000:])
            return run.returncode
        print(f"{args.method} fine-tuning, tiny Llama (2 layers, hidden 64), chat data, "
              f"global batch 8, seq 64, {args.nproc} process(es), {args.strategy}, bf16 autocast on CPU")
        print("step  loss    lr        tokens/s")
        for event in run.of("progress"):
            print(f"{event['step']:>4}  {event['loss']:.4f}  {event['learningRate']:.2e}  {event['tokensPerSecond']:>8.0f}")
        [summary] = run.of("summary")
        print(f"final loss {summary['finalLoss']:.4f} after {summary['step']} steps, "
              f"{summary['runtimeSeconds']} s, {summary['tokensPerSecond']} tokens/s overall")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The lean-trainer levers on the CPU: how far each one moves the loss curve (issue 13).

    python bench/lean_levers_cpu.py [--steps 100] [--lr 3e-3] [--trainer-runs] [--qlora-route]

Part 1 (in process, tiny Llama from a config, random weights, a fixed learnable token
stream): AdamW with fp32 master weights (bf16 autocast) against bf16 master weights with
round-to-nearest, stochastic rounding and Kahan summation (finetune_trainer.bf16_adamw),
and fp32 master weights without autocast; the loss every few steps and the largest gap
to the fp32-master curve.

Part 2 (``--trainer-runs``: the trainer as pods run it, tests/trainer's tiny assets):
plain AdamW against the optimizer step in backward, on one process and on two gloo
ranks under DDP (where the trainer switches DDP's sync off and all-reduces each
gradient in the hook) and FSDP; same global batch 8, maxGradNorm 0, gradient
accumulation 1: the largest loss gap per pair.

Part 3 (``--qlora-route``): the route QLoRA takes under strategy fsdp (the Trainer's
accelerate FSDP2 instead of transformers' load-time FSDP2), taken by LoRA because
bitsandbytes needs CUDA: 2 gloo ranks, a checkpoint, a resume.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "images" / "trainer"))
sys.path.insert(0, str(ROOT / "tests"))


def tiny_llama(dtype):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=61, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         tie_word_embeddings=False)
    return LlamaForCausalLM(config).to(dtype)


def curve(model, optimizer, batches, autocast: bool) -> list[float]:
    import torch

    losses = []
    for ids in batches:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def part1(steps: int, lr: float) -> None:
    import torch

    from finetune_trainer.bf16_adamw import BF16AdamW

    torch.manual_seed(0)
    pattern = torch.randint(0, 61, (32,))
    batches = [torch.stack([pattern.roll(int(s)) for s in torch.randint(0, 32, (4,))]) for _ in range(steps)]
    curves = {}
    started = time.time()
    model = tiny_llama(torch.float32)
    curves["fp32 master, bf16 autocast"] = curve(model, torch.optim.AdamW(model.parameters(), lr=lr), batches, True)
    model = tiny_llama(torch.float32)
    curves["fp32 master, fp32 compute"] = curve(model, torch.optim.AdamW(model.parameters(), lr=lr), batches, False)
    for rounding in ("nearest", "stochastic", "kahan"):
        model = tiny_llama(torch.bfloat16)
        curves[f"bf16 master, {rounding}"] = curve(model, BF16AdamW(model.parameters(), lr=lr, rounding=rounding),
                                                   batches, False)
    reference = curves["fp32 master, bf16 autocast"]
    marks = sorted({0, *range(steps // 5 - 1, steps, max(1, steps // 5))})
    print(f"Part 1: tiny Llama (2 layers, hidden 32), batch 4 x 32 tokens, AdamW lr {lr}, {steps} steps "
          f"({time.time() - started:.0f} s)")
    print(f"{'optimizer':<28}" + "".join(f"{'step ' + str(m + 1):>10}" for m in marks) + f"{'max gap':>10}{'final gap':>11}")
    for name, losses in curves.items():
        gap = max(abs(a - b) for a, b in zip(losses, reference))
        print(f"{name:<28}" + "".join(f"{losses[m]:>10.4f}" for m in marks)
              + f"{gap:>10.4f}{losses[-1] - reference[-1]:>+11.4f}")


def part2() -> None:
    from trainer.conftest import run_trainer, trainer_config, write_config
    from trainer.trainer_assets import build_assets

    pairs = [("1 process", 1, "ddp", 8), ("2 ranks DDP", 2, "ddp", 4), ("2 ranks FSDP", 2, "fsdp", 4)]
    print("\nPart 2: the trainer, tiny Llama, global batch 8, 6 steps, maxGradNorm 0: plain AdamW vs step in backward")
    print(f"{'setup':<16}{'plain final':>12}{'in-bwd final':>13}{'max gap':>10}{'seconds':>9}")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        assets = build_assets(work / "assets")
        for label, nproc, strategy, micro in pairs:
            results = {}
            started = time.time()
            for in_backward in (False, True):
                folder = work / f"{label.replace(' ', '-')}-{in_backward}"
                config = trainer_config(assets, folder, strategy=strategy, microBatchSize=micro, gradientAccumulation=1,
                                        maxGradNorm=0, maxSteps=6, checkpoint=None, optimizerInBackward=in_backward)
                run = run_trainer(write_config(folder, config), nproc=nproc, timeout=1800)
                if run.returncode != 0:
                    print(run.output[-3000:])
                    raise SystemExit(run.returncode)
                results[in_backward] = run.losses()
            gap = max(abs(results[True][s] - results[False][s]) for s in results[False])
            print(f"{label:<16}{results[False][6]:>12.6f}{results[True][6]:>13.6f}{gap:>10.2e}"
                  f"{time.time() - started:>9.0f}")


FORCED_ROUTE = """
import sys
import finetune_trainer.model_setup as ms
# QLoRA's FSDP route (the Trainer's accelerate FSDP2), taken here by LoRA: bitsandbytes needs CUDA.
ms.fsdp_route = lambda cfg, world: ms.FSDP_ACCELERATE if cfg.strategy == "fsdp" and world > 1 else ms.FSDP_NONE
from finetune_trainer.run import main
sys.exit(main(sys.argv[1:]))
"""


def part3() -> None:
    """QLoRA's FSDP route without bitsandbytes: LoRA through accelerate FSDP2 on 2 gloo
    ranks, a checkpoint at step 4, a resume to step 8."""
    import os
    import subprocess

    from trainer.conftest import REPO, TrainerRun, trainer_config, write_config
    from trainer.trainer_assets import build_assets

    print("\nPart 3: the QLoRA FSDP route (accelerate FSDP2, decoder layers + adapters as units) with LoRA, "
          "2 gloo ranks")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        assets = build_assets(work / "assets")
        entry = work / "route.py"
        entry.write_text(FORCED_ROUTE)
        env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1",
                   PYTHONPATH=str(ROOT / "images" / "trainer"))
        runs = []
        for attempt, steps in ((1, 6), (2, 8)):
            config = trainer_config(assets, work, method="lora", learningRate=1e-2, strategy="fsdp", microBatchSize=2,
                                    gradientAccumulation=2, maxSteps=steps, attempt=attempt,
                                    lora={"rank": 8, "alpha": 16, "dropout": 0.0})
            path = write_config(work, config)
            done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                                   "2", str(entry), "--config", str(path)], cwd=REPO, env=env, capture_output=True,
                                  text=True, timeout=1800)
            import json

            events = [json.loads(line) for line in done.stdout.splitlines() if line.startswith('{"event"')]
            run = TrainerRun(done.returncode, done.stdout + done.stderr, events)
            if run.returncode != 0:
                print(run.output[-3000:])
                raise SystemExit(run.returncode)
            runs.append(run)
        first, second = runs
        [resume] = second.of("resume")
        print(f"attempt 1 losses {first.losses()}")
        print(f"attempt 2 resumed from step {resume['step']} (optimizerRestored {resume['optimizerRestored']}): "
              f"{second.losses()}")
        print(f"step 5 and 6: {first.losses()[5]:.6f} / {second.losses()[5]:.6f}, "
              f"{first.losses()[6]:.6f} / {second.losses()[6]:.6f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--trainer-runs", action="store_true", help="also part 2 (six trainer runs, minutes)")
    parser.add_argument("--qlora-route", action="store_true",
                        help="also part 3: QLoRA's FSDP route with LoRA on 2 gloo ranks, checkpoint and resume")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(1)
    part1(args.steps, args.lr)
    if args.trainer_runs:
        part2()
    if args.qlora_route:
        part3()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""DeepSpeed ZeRO's real code path, measured on the CPU: the trainer's DeepSpeed config (explicit bucket
sizes) against DeepSpeed's own defaults (what the trainer got before), and the memory model's terms.

    python bench/zero_truth.py [--width 2048] [--layers 4] [--worlds 1,2] [--stages 1,2,3]

Each setup runs DeepSpeed (deepspeed.initialize with a torch AdamW, as the transformers Trainer
passes its optimizer; bf16; overlap_comm and contiguous_gradients on) over `world` gloo ranks on
the CPU (DS_ACCELERATOR=cpu), real tensors, a stack of bias-free Linear layers, two steps; each
rank's peak allocated bytes are counted by the trainer's PeakTracker (every tensor storage the
dispatcher creates, plus the model's own parameters). Not fake tensors: DeepSpeed's engine
needs real storage (flattening, .item() on norms), so the model is small and the bucket sizes
dominate the comparison. Offload is not measured: DeepSpeed's CPU Adam needs its C++ op built
(minutes of compilation per fresh environment), and on a CPU-only host "offload" moves nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RANK_SCRIPT = r'''
import json, os, sys
os.environ.setdefault("DS_ACCELERATOR", "cpu")
import torch, deepspeed
sys.path.insert(0, sys.argv[1])
from finetune_trainer.contract import deepspeed_config
from finetune_trainer.peak_tracker import PeakTracker
stage, width, layers, defaults = int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5] == "1"
cfg = deepspeed_config(stage, "none")
if defaults:
    for k in list(cfg["zero_optimization"]):
        if "bucket" in k or k.startswith("stage3_") and k != "stage3_gather_16bit_weights_on_model_save":
            del cfg["zero_optimization"][k]
world = int(os.environ["WORLD_SIZE"])
cfg.update(train_micro_batch_size_per_gpu=1, gradient_accumulation_steps=1, train_batch_size=world,
           gradient_clipping=1.0, bf16={"enabled": True}, fp16={"enabled": False})
deepspeed.init_distributed(dist_backend="gloo")
model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(layers)])
tracker = PeakTracker()
with tracker:
    for p in model.parameters():
        tracker.track(p)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-4),
                                           config=cfg)
    x = torch.randn(1, width, dtype=torch.bfloat16)
    for _ in range(2):
        tracker.reset_peak()
        loss = engine(x).float().sum()
        engine.backward(loss)
        engine.step()
print(json.dumps({"peak": tracker.peak}))
'''


def run(stage: int, world: int, width: int, layers: int, defaults: bool, port: int) -> int:
    procs = []
    for rank in range(world):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                   LOCAL_RANK=str(rank), DS_ACCELERATOR="cpu")
        procs.append(subprocess.Popen([sys.executable, "-c", RANK_SCRIPT, str(ROOT / "images" / "trainer"), str(stage),
                                       str(width), str(layers), "1" if defaults else "0"],
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True))
    peaks = []
    for p in procs:
        out, _ = p.communicate(timeout=900)
        lines = [line for line in out.splitlines() if line.startswith("{")]
        if p.returncode != 0 or not lines:
            raise RuntimeError(f"stage {stage} world {world}: rank failed (exit {p.returncode})")
        peaks.append(json.loads(lines[-1])["peak"])
    return max(peaks)


def model_bytes(stage: int, world: int, params: int) -> float:
    """The memory model's ZeRO terms (sizing/memory.py) for a bf16 model of `params` trainable parameters."""
    sys.path.insert(0, str(ROOT / "operator"))
    sys.path.insert(0, str(ROOT / "images" / "trainer"))
    from finetune_operator.sizing.memory import _zero_buckets

    n = world
    weights = 2 * params / (n if stage == 3 else 1)
    grads = 2 * params / (n if stage >= 2 else 1)
    states = (4 + 8) * params / n
    from finetune_operator.sizing.memory import _zero3_partition_extra

    extra = _zero3_partition_extra(params, n) if stage == 3 else 0.0
    return weights + grads + states + _zero_buckets(f"zero{stage}", 2.0, params, n) + extra


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--worlds", default="1,2")
    ap.add_argument("--stages", default="1,2,3")
    ns = ap.parse_args(argv)
    params = ns.width * ns.width * ns.layers
    mb = 1e6
    print(f"{params / 1e6:.1f}M parameters (bf16, torch AdamW), peak allocated per rank, MB")
    print(f"{'stage':>5} {'world':>5} {'our config':>11} {'model':>8} {'err':>6} {'DS defaults':>12}")
    port = 29700
    for stage in [int(s) for s in ns.stages.split(",")]:
        for world in [int(w) for w in ns.worlds.split(",")]:
            port += 1
            ours = run(stage, world, ns.width, ns.layers, False, port)
            port += 1
            theirs = run(stage, world, ns.width, ns.layers, True, port)
            predicted = model_bytes(stage, world, params)
            print(f"{stage:>5} {world:>5} {ours / mb:>11.1f} {predicted / mb:>8.1f} {predicted / ours - 1:>+6.1%}"
                  f" {theirs / mb:>12.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Run a script as the ranks of one gloo job on this machine (the CPU truths of DeepSpeed: zero_truth.py,
sequence_parallel_truth.py), each rank a fresh process as in a pod, and read each rank's last JSON line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

TRAINER = Path(__file__).resolve().parents[1] / "images" / "trainer"


def run_ranks(script: str, args: list[str], world: int, port: int, what: str) -> list[dict]:
    """`script` run by `world` ranks (`python -c script TRAINER *args`, DS_ACCELERATOR=cpu, one thread
    each); each rank's last line that starts with "{", parsed. A rank that fails raises RuntimeError
    with `what` and the end of its stderr."""
    procs = []
    for rank in range(world):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                   LOCAL_RANK=str(rank), DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, "-c", script, str(TRAINER), *args],
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    results = []
    for p in procs:
        out, err = p.communicate(timeout=1800)
        lines = [line for line in out.splitlines() if line.startswith("{")]
        if p.returncode != 0 or not lines:
            raise RuntimeError(f"{what}: rank failed (exit {p.returncode}): {err[-2000:]}")
        results.append(json.loads(lines[-1]))
    return results

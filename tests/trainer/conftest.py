"""Fixtures for the trainer tests: tiny assets and a way to run the trainer as pods do."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from .trainer_assets import build_assets

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def assets(tmp_path_factory) -> dict[str, Path]:
    return build_assets(tmp_path_factory.mktemp("trainer-assets"))


def trainer_config(assets: dict[str, Path], workdir: Path, **overrides: Any) -> dict[str, Any]:
    config: dict[str, Any] = {
        "jobName": "tiny",
        "model": {"path": str(assets["model"])},
        "dataset": {"path": str(assets["chat"]), "format": "chat"},
        "method": "full",
        "precision": "bf16",
        "learningRate": 3e-3,
        "sequenceLength": 64,
        "microBatchSize": 4,
        "gradientAccumulation": 2,
        "maxSteps": 10,
        "outputDirectory": str(workdir / "out"),
        "checkpoint": {"directory": str(workdir / "ckpt"), "everySteps": 4, "keepLast": 2},
        "reportPath": str(workdir / "termination-log"),
    }
    config.update(overrides)
    return config


def write_config(workdir: Path, config: dict[str, Any], name: str = "config.json") -> Path:
    workdir.mkdir(parents=True, exist_ok=True)
    path = workdir / name
    path.write_text(json.dumps(config, indent=2))
    return path


@dataclass
class TrainerRun:
    returncode: int
    output: str
    events: list[dict[str, Any]] = field(default_factory=list)

    def of(self, event: str, rank: int | None = 0) -> list[dict[str, Any]]:
        return [e for e in self.events if e["event"] == event and (rank is None or e.get("rank") == rank)]

    def losses(self) -> dict[int, float]:
        return {e["step"]: e["loss"] for e in self.of("progress")}


def run_trainer(config_path: Path, nproc: int = 1, launcher: bool = False, timeout: int = 300,
                extra_env: dict[str, str] | None = None) -> TrainerRun:
    """Run the trainer in a fresh process, as a pod does: one process, torchrun, or the launcher."""
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1",
               TOKENIZERS_PARALLELISM="false", **(extra_env or {}))
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    if launcher:
        command = [sys.executable, "-m", "finetune_trainer.launch", "--config", str(config_path),
                   "--standalone", "--nproc-per-node", str(nproc)]
    elif nproc > 1:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
                   "-m", "finetune_trainer", "--config", str(config_path)]
    else:
        command = [sys.executable, "-m", "finetune_trainer", "--config", str(config_path)]
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    output = done.stdout + done.stderr
    events = []
    for line in done.stdout.splitlines():
        if line.startswith('{"event"'):
            events.append(json.loads(line))
    return TrainerRun(done.returncode, output, events)


def read_report(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())

"""The launcher when the kernel kills one torchrun worker (SIGKILL): no report from the
worker, torchrun exits 1, and the launcher must still say what happened.

Real runs: two ranks under the launcher and torchrun, rank 1 SIGKILLs itself at step 3
(the test-only fault hook; to the launcher it is the same as the kernel's kill). What
the OOM killer leaves besides the SIGKILL, a rise of the memory cgroup's ``oom_kill``
counter, is played by the test on a cgroup-v2 style ``memory.events`` file it hands the
launcher (``--memory-cgroup``); the other test reads this machine's real cgroup.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from finetune_trainer.contract import EXIT_HOST_OOM, EXIT_UNKNOWN

from .conftest import REPO, read_report, trainer_config, write_config

pytestmark = pytest.mark.slow

EVENTS = "low 0\nhigh 0\nmax 0\noom 0\noom_kill {n}\noom_group_kill 0\n"


def launch(config: Path, extra: list[str], on_event=None, timeout: int = 300) -> tuple[int, list[dict], str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1",
               TOKENIZERS_PARALLELISM="false")
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    command = [sys.executable, "-m", "finetune_trainer.launch", "--config", str(config), *extra,
               "--standalone", "--nproc-per-node", "2"]
    proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    events, lines = [], []
    try:
        for line in proc.stdout:
            lines.append(line)
            if line.startswith('{"event"'):
                event = json.loads(line)
                events.append(event)
                if on_event:
                    on_event(event)
        code = proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
    return code, events, "".join(lines)


def _killed_rank_1(assets, tmp_path):
    config = trainer_config(assets, tmp_path, microBatchSize=2, gradientAccumulation=2, checkpoint=None, maxSteps=6,
                            faultInjection={"kind": "kill", "step": 3, "phase": "forward", "rank": 1})
    return write_config(tmp_path, config)


def test_a_worker_killed_with_an_oom_kill_counted_is_host_oom(assets, tmp_path):
    cgroup = tmp_path / "cgroup"
    cgroup.mkdir()
    (cgroup / "memory.events").write_text(EVENTS.format(n=2))

    def oom_killer_counts(event):
        # After the launcher's first read (torchrun has started the ranks), before the kill at step 3.
        if event["event"] == "start":
            (cgroup / "memory.events").write_text(EVENTS.format(n=3))

    code, events, output = launch(_killed_rank_1(assets, tmp_path), ["--memory-cgroup", str(cgroup)],
                                  oom_killer_counts)
    assert code == EXIT_HOST_OOM, output[-3000:]
    report = read_report(tmp_path / "termination-log")
    assert (report["reason"], report["exitCode"], report["rank"]) == ("HostOutOfMemory", EXIT_HOST_OOM, 1)
    assert "SIGKILL" in report["message"] and "oom_kill 2 -> 3" in report["message"]
    assert (report["microBatchSize"], report["sequenceLength"], report["attempt"]) == (2, 64, 1)
    assert [e["reason"] for e in events if e["event"] == "failure" and e.get("source") == "launcher"] == [
        "HostOutOfMemory"]


def test_a_worker_killed_without_an_oom_kill_is_unknown_and_names_it(assets, tmp_path):
    # This machine's own memory cgroup: no OOM kill happens here during the run.
    code, _, output = launch(_killed_rank_1(assets, tmp_path), [])
    assert code == EXIT_UNKNOWN, output[-3000:]
    report = read_report(tmp_path / "termination-log")
    assert (report["reason"], report["exitCode"], report["rank"]) == ("Unknown", EXIT_UNKNOWN, 1)
    assert "rank 1" in report["message"] and "killed by SIGKILL" in report["message"]
    assert "no OOM kill" in report["message"] or "could not be read" in report["message"]

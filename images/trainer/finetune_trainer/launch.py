"""``python -m finetune_trainer.launch --config ... [torchrun options]``

The container entrypoint for multi-GPU pods. It runs torchrun (which reads the
``PET_*`` variables the Kubeflow training operator sets: nproc per node, nnodes, node
rank, master address) with one trainer per GPU, and forwards SIGTERM to it.

torchrun exits 1 whatever its workers' codes were; this wrapper decides the pod's exit
code and makes sure the termination message explains it:

* a worker's own specific report (GPU OOM, data, config) stands, with its exit code;
* a worker killed by SIGKILL writes no report. torchrun knows its exit (``-9``) and
  ``finetune_trainer.torchrun`` hands it over. Whether the kernel's OOM killer did it is
  told by the container's memory cgroup, which counts every OOM kill of a process in it
  (``oom_kill`` in ``memory.events`` on cgroup v2, in ``memory.oom_control`` on v1):
  read before torchrun starts and after it ends, a rise means an OOM kill happened in
  this container during the run. SIGKILL and a rise: ``HostOutOfMemory`` (exit 71).
  SIGKILL and no rise (or no readable counter): ``Unknown`` (exit 1), saying which rank
  died and what the counter showed; a preemption or a person's ``kill -9`` look the same.
  That report replaces a peer's ``Unknown`` (its broken collective is a consequence);
* otherwise the report's code if there is one, else torchrun's.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from .contract import (
    DEFAULT_CONFIG_PATH,
    DEFAULT_REPORT_PATH,
    EXIT_CODE_FOR_REASON,
    ConfigLoadError,
    FailureReason,
    FailureReport,
    Phase,
    TrainerConfig,
    load_trainer_config,
    parse_failure_report,
)
from .reporting import log_json
from .torchrun import WORKER_EXITS_ENV

SIGKILL_EXIT = -int(signal.SIGKILL)


def report_path_for(config: str, override: str | None) -> str:
    if override:
        return override
    try:
        return load_trainer_config(config).report_path
    except ConfigLoadError:
        return DEFAULT_REPORT_PATH


# ------------------------------------------------------------ OOM-kill evidence


@dataclass(frozen=True)
class OomCounter:
    """The kernel's count of OOM kills in this container's memory cgroup, and where it was read."""

    source: str  # e.g. "/sys/fs/cgroup/memory.events"
    kills: int


def memory_cgroup_dir(proc_cgroup: str = "/proc/self/cgroup", mount: str = "/sys/fs/cgroup") -> Path | None:
    """This process's memory cgroup directory, cgroup v2 or v1.

    In a container the cgroup is usually mounted at its own root (cgroup namespace, or
    v1 bind mounts), so the path named in /proc/self/cgroup is tried under the mount and
    the mount root is the fallback.
    """
    root = Path(mount)
    try:
        lines = Path(proc_cgroup).read_text().splitlines()
    except OSError:
        lines = []
    entries = {}
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) == 3:
            for controller in parts[1].split(",") or [""]:
                entries[controller] = parts[2]
    candidates: list[Path] = []
    if (root / "cgroup.controllers").exists():  # unified (v2) hierarchy at the mount
        path = entries.get("", "/").lstrip("/")
        candidates += [root / path, root]
    else:
        v1 = root / "memory"
        path = entries.get("memory", "/").lstrip("/")
        candidates += [v1 / path, v1]
    for candidate in candidates:
        if (candidate / "memory.events").is_file() or (candidate / "memory.oom_control").is_file():
            return candidate
    return None


def read_oom_kills(cgroup: Path | None) -> OomCounter | None:
    """``oom_kill`` of memory.events (v2) or memory.oom_control (v1); None when unreadable."""
    if cgroup is None:
        return None
    for name in ("memory.events", "memory.oom_control"):
        path = Path(cgroup) / name
        try:
            text = path.read_text()
        except OSError:
            continue
        for line in text.splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill" and value.strip().isdigit():
                return OomCounter(str(path), int(value))
    return None


# ---------------------------------------------------------------- the verdict


@dataclass(frozen=True)
class WorkerExit:
    rank: int
    local_rank: int
    pid: int
    exit_code: int
    signal: str | None = None


def read_worker_exits(path: Path) -> list[WorkerExit]:
    try:
        rows = json.loads(path.read_text())
    except (OSError, ValueError):
        return []
    exits = []
    for row in rows if isinstance(rows, list) else []:
        try:
            exits.append(WorkerExit(int(row["rank"]), int(row["localRank"]), int(row["pid"]),
                                    int(row["exitCode"]), row.get("signal")))
        except (KeyError, TypeError, ValueError):
            continue
    return exits


def _oom_evidence(before: OomCounter | None, after: OomCounter | None) -> tuple[bool, str]:
    if before is None or after is None:
        return False, "the memory cgroup's oom_kill counter could not be read, so it cannot be told whether the kernel's OOM killer did it"
    if after.kills > before.kills:
        return True, f"{after.source} counted {after.kills - before.kills} OOM kill(s) during the run (oom_kill {before.kills} -> {after.kills})"
    return False, f"{after.source} counted no OOM kill during the run (oom_kill stayed {after.kills})"


def verdict(
    torchrun_code: int,
    report: FailureReport | None,
    worker_exits: list[WorkerExit],
    oom_before: OomCounter | None,
    oom_after: OomCounter | None,
    cfg: TrainerConfig | None = None,
) -> tuple[int, FailureReport | None]:
    """The pod's exit code, and the report the launcher must write (None: leave the file as it is)."""
    if torchrun_code == 0:
        return 0, None
    if report is not None and report.reason is not FailureReason.UNKNOWN:
        return report.exit_code, None  # a worker said what went wrong
    killed = [w for w in worker_exits if w.exit_code == SIGKILL_EXIT]
    if killed:
        who = ", ".join(f"rank {w.rank} (local rank {w.local_rank}, pid {w.pid})" for w in killed)
        what = f"worker {who} killed by SIGKILL"
    elif torchrun_code == SIGKILL_EXIT:
        what = "torchrun (the agent of this node's workers) killed by SIGKILL"
    else:
        if report is not None:
            return report.exit_code, None
        # A signal death of torchrun itself (negative on Popen) maps to the shell's 128+n.
        return (128 - torchrun_code if torchrun_code < 0 else torchrun_code), None
    oom, evidence = _oom_evidence(oom_before, oom_after)
    if oom:
        reason, message = FailureReason.HOST_OUT_OF_MEMORY, f"{what}; {evidence}: the kernel's OOM killer (host memory)"
    else:
        reason, message = FailureReason.UNKNOWN, f"{what}; {evidence}"
    if report is not None:
        message += f". A peer then failed: {report.message}"
    # Where the job was: a peer's report (the step whose collective broke), else unknown (setup, 0).
    new = FailureReport(
        reason=reason,
        phase=report.phase if report else Phase.SETUP,
        step=report.step if report else 0,
        message=message,
        exit_code=EXIT_CODE_FOR_REASON[reason],
        micro_batch_size=cfg.micro_batch_size if cfg else None,
        sequence_length=cfg.sequence_length if cfg else None,
        gradient_accumulation=cfg.gradient_accumulation if cfg else None,
        rank=killed[0].rank if killed else (report.rank if report else 0),
        world_size=report.world_size if report else None,
        attempt=cfg.attempt if cfg else (report.attempt if report else None),
    )
    return new.exit_code, new


def exit_code_for(torchrun_code: int, report_path: str) -> int:
    """The pod's exit code from torchrun's and the report alone (no worker exits known)."""
    return verdict(torchrun_code, _read_report(report_path), [], None, None)[0]


def _read_report(path: str) -> FailureReport | None:
    try:
        return parse_failure_report(Path(path).read_text())
    except OSError:
        return None


def _write(report: FailureReport, path: str) -> None:
    # All workers are gone: the launcher is the last writer and replaces what is there.
    try:
        Path(path).write_text(report.to_termination_message())
    except OSError as exc:
        print(f"finetune_trainer.launch: cannot write the failure report to {path}: {exc}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="finetune_trainer.launch", description=__doc__)
    parser.add_argument("--config", default=DEFAULT_CONFIG_PATH)
    parser.add_argument("--report-path", default=None)
    parser.add_argument("--memory-cgroup", default=None,
                        help="memory cgroup directory whose oom_kill counter is read (default: this process's)")
    args, torchrun_args = parser.parse_known_args(argv)
    report_path = report_path_for(args.config, args.report_path)
    try:
        cfg = load_trainer_config(args.config)
    except ConfigLoadError:
        cfg = None  # the trainer reports it as a ConfigError
    cgroup = Path(args.memory_cgroup) if args.memory_cgroup else memory_cgroup_dir()
    workdir = Path(tempfile.mkdtemp(prefix="finetune-launch-"))
    exits_path = workdir / "worker-exits.json"
    command = [sys.executable, "-m", "finetune_trainer.torchrun", *torchrun_args,
               "-m", "finetune_trainer", "--config", args.config]
    if args.report_path:
        command += ["--report-path", args.report_path]
    oom_before = read_oom_kills(cgroup)
    child = subprocess.Popen(command, env=dict(os.environ, **{WORKER_EXITS_ENV: str(exits_path)}))

    def forward(signum, _frame):
        child.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    try:
        torchrun_code = child.wait()
        oom_after = read_oom_kills(cgroup)
        code, report = verdict(torchrun_code, _read_report(report_path), read_worker_exits(exits_path),
                               oom_before, oom_after, cfg)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    if report is not None:
        _write(report, report_path)
        log_json("failure", source="launcher", **report.model_dump(mode="json", by_alias=True, exclude_none=True))
    return code


if __name__ == "__main__":
    sys.exit(main())

"""``python -m finetune_trainer.launch --config ... [torchrun options]``

The container entrypoint for multi-GPU pods. It runs torchrun (which reads the
``PET_*`` variables the Kubeflow training operator sets: nproc per node, nnodes, node
rank, master address) with one trainer per GPU, and forwards SIGTERM to it.

torchrun exits 1 whatever its workers' codes were; this wrapper reads the failure
report the failed rank wrote and exits with the report's documented code instead, so
the pod's exit code and its termination message agree.
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
from pathlib import Path

from .contract import DEFAULT_CONFIG_PATH, DEFAULT_REPORT_PATH, ConfigLoadError, load_trainer_config, parse_failure_report


def report_path_for(config: str, override: str | None) -> str:
    if override:
        return override
    try:
        return load_trainer_config(config).report_path
    except ConfigLoadError:
        return DEFAULT_REPORT_PATH


def exit_code_for(torchrun_code: int, report_path: str) -> int:
    """The exit code of the pod: the report's when torchrun failed and a report exists."""
    if torchrun_code == 0:
        return 0
    try:
        report = parse_failure_report(Path(report_path).read_text())
    except OSError:
        report = None
    if report is not None:
        return report.exit_code
    # A signal death of torchrun itself (negative on Popen) maps to the shell's 128+n.
    return 128 - torchrun_code if torchrun_code < 0 else torchrun_code


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="finetune_trainer.launch", description=__doc__)
    parser.add_argument("--config", default=DEFAULT_CONFIG_PATH)
    parser.add_argument("--report-path", default=None)
    args, torchrun_args = parser.parse_known_args(argv)
    report_path = report_path_for(args.config, args.report_path)
    command = [sys.executable, "-m", "torch.distributed.run", *torchrun_args,
               "-m", "finetune_trainer", "--config", args.config]
    if args.report_path:
        command += ["--report-path", args.report_path]
    child = subprocess.Popen(command)

    def forward(signum, _frame):
        child.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    return exit_code_for(child.wait(), report_path)


if __name__ == "__main__":
    sys.exit(main())

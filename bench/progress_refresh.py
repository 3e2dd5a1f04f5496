"""How fresh status.progress stays with many running jobs: the real ProgressPoller (due_now/poll,
its per-job interval, read-rate cap and worker cap) over a simulated clock, with a log source that
answers at once with a new progress line and a sink that counts writes. No cluster, no threads:
each simulated tick (the loop's 0.2 s) hands out what due_now() picks and polls it.

    python bench/progress_refresh.py [--jobs 10 100 500 1000 5000] [--seconds 600] [--interval 20]
                                     [--reads-per-second 5] [--workers 2]

Prints per job count: reads/s and writes/s against the API server (all jobs together) and the time
between two reads of one job (mean, p99, max) once the first round is done. Beyond
interval x reads-per-second running jobs (100 at the defaults) the read-rate cap sets the refresh
period instead: about jobs / reads-per-second seconds.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "operator"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "images" / "trainer"))

from finetune_operator.progress import Target  # noqa: E402
from finetune_operator.shell.progress_poller import PollerSettings, ProgressPoller  # noqa: E402
from finetune_trainer.contract import ProgressReport  # noqa: E402

from finetune_operator.shell.progress_poller import LOOP_SECONDS  # noqa: E402

TICK = LOOP_SECONDS  # the poller's loop looks this often (and when a read ends: reads here take no time)


def simulate(jobs: int, seconds: float, settings: PollerSettings) -> dict[str, float]:
    now = [0.0]
    reads: dict[str, list[float]] = {}
    writes = [0]
    steps: dict[str, int] = {}

    def read(target: Target, since: int | None, tail_lines: int, limit_bytes: int) -> str:
        reads.setdefault(target.pod, []).append(now[0])
        steps[target.pod] = steps.get(target.pod, 0) + 1
        return ProgressReport(time=1_800_000_000 + now[0], attempt=1, step=steps[target.pod],
                              max_steps=10_000).to_log_line()

    def write(target: Target, progress) -> None:
        writes[0] += 1

    poller = ProgressPoller(read, write, settings, clock=lambda: now[0])
    for i in range(jobs):
        poller.track(("bench", f"job-{i}"), Target("bench", f"job-{i}", 1, f"pod-{i}", "pytorch"))
    while now[0] < seconds:
        for key in poller.due_now():
            poller.poll(key)
        now[0] += TICK
    warm = seconds / 2  # after the first round, in steady state
    gaps = [b - a for times in reads.values() for a, b in zip(times, times[1:]) if a >= warm]
    gaps.sort()
    total_reads = sum(len(t) for t in reads.values())
    return {
        "reads_per_second": total_reads / seconds,
        "writes_per_second": writes[0] / seconds,
        "gap_mean": statistics.fmean(gaps) if gaps else float("nan"),
        "gap_p99": gaps[int(0.99 * (len(gaps) - 1))] if gaps else float("nan"),
        "gap_max": gaps[-1] if gaps else float("nan"),
        "never_read": sum(1 for i in range(jobs) if f"pod-{i}" not in reads),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, nargs="+", default=[10, 100, 500, 1000, 5000])
    parser.add_argument("--seconds", type=float, default=600.0, help="simulated seconds")
    parser.add_argument("--interval", type=float, default=20.0)
    parser.add_argument("--reads-per-second", type=float, default=5.0)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    settings = PollerSettings(interval=args.interval, workers=args.workers,
                              max_reads_per_second=args.reads_per_second)
    print(f"interval {args.interval:g} s, at most {args.reads_per_second:g} reads/s, {args.workers} workers, "
          f"{args.seconds:g} simulated s")
    print(f"{'jobs':>6} {'reads/s':>8} {'writes/s':>9} {'gap mean':>9} {'gap p99':>8} {'gap max':>8} {'never':>6} {'cpu s':>6}")
    for jobs in args.jobs:
        started = time.process_time()
        r = simulate(jobs, args.seconds, settings)
        cpu = time.process_time() - started
        print(f"{jobs:>6} {r['reads_per_second']:>8.2f} {r['writes_per_second']:>9.2f} {r['gap_mean']:>8.1f}s "
              f"{r['gap_p99']:>7.1f}s {r['gap_max']:>7.1f}s {r['never_read']:>6} {cpu:>6.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

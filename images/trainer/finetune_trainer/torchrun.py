"""``python -m finetune_trainer.torchrun [torchrun options] -m finetune_trainer ...``

torchrun itself, plus one thing the launcher needs and torchrun's exit code hides: how
each failed worker ended. A worker the kernel kills (SIGKILL) writes no failure report;
torchrun knows its exit (``exitcode: -9``) but exits 1 whatever happened. On a failure
this writes those exits as JSON to ``$FINETUNE_WORKER_EXITS`` (when set), then fails
exactly as torchrun does.
"""

from __future__ import annotations

import json
import os
import sys

WORKER_EXITS_ENV = "FINETUNE_WORKER_EXITS"


def failures_as_json(failures) -> list[dict]:
    """torchrun's ``{global rank: ProcessFailure}`` as plain data, by rank."""
    out = []
    for rank, failure in sorted(failures.items()):
        signal = failure.signal_name() if failure.exitcode < 0 else None
        out.append({"rank": int(rank), "localRank": int(failure.local_rank), "pid": int(failure.pid),
                    "exitCode": int(failure.exitcode), "signal": signal})
    return out


def main(argv: list[str] | None = None) -> None:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun_main

    try:
        torchrun_main(argv)
    except ChildFailedError as exc:
        path = os.environ.get(WORKER_EXITS_ENV)
        if path:
            try:
                with open(path, "w") as handle:
                    json.dump(failures_as_json(exc.failures), handle)
            except OSError as err:  # the launcher then knows less, and says so
                print(f"finetune_trainer.torchrun: cannot record worker exits in {path}: {err}", file=sys.stderr)
        raise


if __name__ == "__main__":
    main()

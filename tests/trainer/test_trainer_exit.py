"""How a trainer process exits beside live process-group threads (teardown.exit_process).

The flake in test_deepspeed_zero2_lora_then_zero3_resume (``terminate called without an
active exception``, SIGABRT) was a race between interpreter finalization and a gloo
worker thread that frees the last collective's tensors (which needs the GIL). The race
depends on scheduling; this harness makes it certain: rank 1 joins the collective a
second late, and rank 0's interpreter finalization is held open (a finalizer that sleeps,
releasing the GIL) until the collective completes in rank 0's gloo worker thread.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap

import pytest

from .conftest import REPO

pytestmark = pytest.mark.slow

HARNESS = textwrap.dedent(
    """
    import atexit, mmap, os, sys, time
    import torch, torch.distributed as dist
    from finetune_trainer.teardown import exit_process  # imported now: an import reads files

    mode = sys.argv[1]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if rank == 1:
        # The helper peer: joins late, then leaves without finalizing (it is not under test).
        time.sleep(1.0)
        try:
            dist.all_reduce(torch.ones(4))
        finally:
            os._exit(0)

    # A thread waiting for the GIL asks its holder to let go only after this interval:
    # gloo's worker, done at ~1 s, then waits for the GIL until the main thread releases
    # it by itself, which it does first inside finalization (the sleeping finalizer).
    sys.setswitchinterval(60)

    class HoldsFinalizationOpen:
        def __del__(self):
            time.sleep(2)  # module teardown: Python has already marked itself finalizing

    keep = HoldsFinalizationOpen()
    # An atexit handler leaves its mark in a shared mapping: no I/O call that would
    # release the GIL before finalization (and so let the worker finish in time).
    with open(sys.argv[2], "r+b") as flag_file:
        flag = mmap.mmap(flag_file.fileno(), 1)
    atexit.register(flag.__setitem__, 0, ord("1"))
    t = torch.ones(4)
    work = dist.all_reduce(t, async_op=True)
    del work, t  # only gloo's worker thread holds the tensor now
    print("rank 0 leaving", flush=True)
    # Hold the GIL (no I/O, no sleep) until the collective has completed in the worker.
    end = time.perf_counter() + 2.5
    while time.perf_counter() < end:
        pass
    if mode == "trainer":
        exit_process(0)
    sys.exit(0)
    """
)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _run_pair(tmp_path, mode: str) -> tuple[subprocess.CompletedProcess, bool]:
    """Rank 0's exit status and output, and whether its atexit handlers ran."""
    script = tmp_path / "harness.py"
    script.write_text(HARNESS)
    flag = tmp_path / "atexit-flag"
    flag.write_bytes(b"0")
    port = _free_port()
    procs = []
    for rank in (0, 1):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                   OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, str(script), mode, str(flag)], cwd=REPO, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outputs = [p.communicate(timeout=120)[0] for p in procs]
    return subprocess.CompletedProcess(procs[0].args, procs[0].returncode, outputs[0]), flag.read_bytes() == b"1"


def test_plain_exit_beside_a_gloo_worker_aborts(tmp_path):
    """The hazard itself: if this stops failing, torch no longer aborts here and the
    harness no longer provokes the race (revisit teardown.exit_process)."""
    plain, _ = _run_pair(tmp_path, "sys-exit")
    assert "rank 0 leaving" in plain.stdout, plain.stdout
    assert plain.returncode == -6 and "terminate called without an active exception" in plain.stdout, plain


def test_trainer_exit_beside_a_gloo_worker_is_clean(tmp_path):
    run, atexit_ran = _run_pair(tmp_path, "trainer")
    assert run.returncode == 0, run.stdout
    assert "terminate called" not in run.stdout
    # The exit work that is safe still happens (logging flushes in atexit handlers).
    assert atexit_ran

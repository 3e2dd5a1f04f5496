"""How a trainer process ends: an orderly distributed shutdown, then an exit that cannot abort.

Why this exists: a trainer that returned from ``main`` and let the interpreter exit
normally aborted now and then (``terminate called without an active exception``,
SIGABRT, exit code -6 under torchrun). The cause, seen with gdb: the process groups'
worker threads (gloo's ``pt_gloo_runloop``) outlive ``main``. Such a thread drops its
reference to a finished collective's work object only *after* it has woken the caller;
when the caller's Python reference to the tensor is already gone, that drop frees the
tensor's Python object, which needs the GIL (``~AsyncAllreduceWork`` ->
``TensorImpl::decref_pyobject`` -> ``gil_scoped_acquire``). If the main thread is in
``Py_FinalizeEx`` by then, Python ends the GIL-waiting thread with ``pthread_exit``; the
forced unwind runs into the work's noexcept destructor and the C++ runtime calls
``std::terminate``. It is a race, so it shows more on a loaded machine (a descheduled
worker thread), and in production it turns a finished run into a failed pod.

Two parts:

* ``close_distributed`` (successful runs only): every rank meets at a barrier after its
  last collective, then destroys its process groups (NCCL communicators are finalized
  there) and collects garbage cycles, so that groups no one holds are destructed now, in
  the main thread, where their destructors drain the queue and join the threads.
  DeepSpeed keeps handles to the groups (ZeRO-3 parameters, its engine, module globals),
  so their threads can survive this; hence the second part.
* ``exit_process``: while any process-group thread is alive, the interpreter is never
  finalized. Python's exit work that is safe (joining non-daemon threads, atexit
  handlers, flushing) is done here, then ``os._exit``. A failed rank leaves at once:
  its peers may be stuck in a collective that never completes.
"""

from __future__ import annotations

import atexit
import gc
import os
import sys
import threading
import time

from .reporting import log_json

# Native threads of torch.distributed's backends (names from /proc/<pid>/task/*/comm).
_BACKEND_THREAD_PREFIXES = ("pt_gloo", "gloo_", "pt_nccl")


def backend_threads() -> list[str]:
    """Names of this process's live process-group threads (Linux; empty elsewhere)."""
    names = []
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return names
    for tid in tasks:
        try:
            with open(f"/proc/self/task/{tid}/comm") as handle:
                name = handle.read().strip()
        except OSError:  # the thread ended while we looked
            continue
        if name.startswith(_BACKEND_THREAD_PREFIXES):
            names.append(name)
    return sorted(names)


def close_distributed() -> list[str]:
    """Barrier, destroy every process group, collect; returns the backend threads still alive.

    A no-op (empty list) without an initialised process group. Collective: every rank
    calls it after its last collective.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return []
    # Every rank is past its last collective before any group goes away; otherwise a
    # fast rank could tear down while a slow one still talks to it.
    dist.barrier()
    dist.destroy_process_group()
    # Groups referenced only from garbage cycles (Trainer <-> callbacks) go now.
    gc.collect()
    left = backend_threads()
    log_json("shutdown", backendThreadsLeft=len(left))
    return left


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):
            pass


def exit_process(code: int) -> None:
    """End the process with ``code``; never finalizes the interpreter beside live backend threads."""
    _flush()
    if code:
        # A failed rank must not wait in process-group teardown for peers that are
        # stuck in a collective; torchrun stops them once this process is gone.
        os._exit(code)
    if not backend_threads():
        sys.exit(0)  # nothing can race with finalization: the normal exit
    # What a normal exit does before finalizing, which is safe with those threads
    # alive (the interpreter is still whole): threading's shutdown (its exit hooks, which
    # stop idle executor workers, then joining non-daemon threads), the atexit handlers
    # (logging's flush among them), flushing the streams. The interpreter calls the
    # first two itself; they are private, hence the getattr.
    for step in (getattr(threading, "_shutdown", None), getattr(atexit, "_run_exitfuncs", None)):
        if step is not None:
            step()
    _flush()
    os._exit(0)

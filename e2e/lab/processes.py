"""Start lab processes, remember them by pid, and stop exactly those."""

from __future__ import annotations

import concurrent.futures
import ctypes
import os
import queue
import signal
import socket
import ssl
import subprocess
import threading
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

PR_SET_PDEATHSIG = 1


class LabStartError(RuntimeError):
    pass


@dataclass
class Proc:
    name: str
    pid: int
    start_ticks: int  # /proc/<pid>/stat field 22: tells a reused pid from ours
    log: str
    argv: list[str] | None = None  # how it was started, so it can be started again in place

    def to_json(self) -> dict:
        return asdict(self)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_ports(names: list[str]) -> dict[str, int]:
    # Hold every socket until all are chosen so no two names get the same port.
    socks, ports = [], {}
    try:
        for name in names:
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
            ports[name] = s.getsockname()[1]
    finally:
        for s in socks:
            s.close()
    return ports


def proc_start_ticks(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may contain spaces; fields after the last ')' are fixed.
    rest = stat.rsplit(")", 1)[1].split()
    return int(rest[19])


def is_alive(p: Proc) -> bool:
    ticks = proc_start_ticks(p.pid)
    if ticks is None or ticks != p.start_ticks:
        return False
    try:
        state = Path(f"/proc/{p.pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _die_with_parent() -> None:
    # Used for labs owned by a test session: if pytest is killed, the kernel stops the lab too.
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


_spawner: "queue.Queue[tuple[Callable[[], Proc], concurrent.futures.Future]] | None" = None
_spawner_lock = threading.Lock()


def _spawn_from_lasting_thread(fn: Callable[[], Proc]) -> Proc:
    """PR_SET_PDEATHSIG fires when the *thread* that forked the child ends, not the process: a
    lab process started from a short-lived thread (e.g. a kube-apiserver restarted by a chaos
    thread) would be sent SIGTERM as soon as that thread returns. Such starts are run by one
    daemon thread that lives as long as this process."""
    global _spawner
    with _spawner_lock:
        if _spawner is None:
            _spawner = queue.Queue()

            def serve() -> None:
                while True:
                    job, future = _spawner.get()
                    try:
                        future.set_result(job())
                    except BaseException as exc:  # handed to the caller
                        future.set_exception(exc)

            threading.Thread(target=serve, name="lab-spawner", daemon=True).start()
    future: concurrent.futures.Future = concurrent.futures.Future()
    _spawner.put((fn, future))
    return future.result()


def start(name: str, argv: list[str], log_dir: Path, env: dict | None = None, die_with_parent: bool = False) -> Proc:
    if die_with_parent and threading.current_thread() is not threading.main_thread():
        return _spawn_from_lasting_thread(lambda: _start(name, argv, log_dir, env, die_with_parent))
    return _start(name, argv, log_dir, env, die_with_parent)


def _start(name: str, argv: list[str], log_dir: Path, env: dict | None, die_with_parent: bool) -> Proc:
    log_path = log_dir / f"{name}.log"
    with open(log_path, "ab") as log:
        popen = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,  # a Ctrl-C in the terminal reaches the lab only through `down`
            preexec_fn=_die_with_parent if die_with_parent else None,
        )
    ticks = proc_start_ticks(popen.pid) or 0
    # The Popen object is dropped: the lab is stopped by pid, possibly from another process.
    popen.returncode = 0  # keeps Popen.__del__ from warning about a "still running" child
    return Proc(name, popen.pid, ticks, str(log_path), list(argv))


def stop(procs: list[Proc], grace: float = 10.0) -> list[str]:
    """SIGTERM each live process (in the given order), then SIGKILL what is left; returns
    the names that had to be killed."""
    killed = []
    live = [p for p in procs if is_alive(p)]
    for p in live:
        try:
            os.kill(p.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(is_alive(p) for p in live):
        _reap(live)
        time.sleep(0.1)
    for p in live:
        if is_alive(p):
            killed.append(p.name)
            try:
                os.kill(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and any(is_alive(p) for p in live):
        _reap(live)
        time.sleep(0.05)
    _reap(live)
    return killed


def _reap(procs: list[Proc]) -> None:
    # Lab processes started by this very process linger as zombies until waited for; only
    # our own pids are waited on, so other children's exit statuses are left alone.
    for p in procs:
        try:
            os.waitpid(p.pid, os.WNOHANG)
        except ChildProcessError:
            pass


def tail(path: str | Path, lines: int = 25) -> str:
    try:
        text = Path(path).read_text(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:])


def wait_until(what: str, check: Callable[[], bool], proc: Proc | None, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    last_error: Exception | None = None
    while time.monotonic() < deadline:
        if proc is not None and not is_alive(proc):
            _reap([proc])
            raise LabStartError(f"{proc.name} exited while waiting for {what}; last log lines:\n{tail(proc.log)}")
        try:
            if check():
                return
        except Exception as exc:  # not up yet
            last_error = exc
        time.sleep(0.2)
    detail = f"\nlast error: {last_error!r}" if last_error else ""
    logs = f"\nlast log lines of {proc.name}:\n{tail(proc.log)}" if proc else ""
    raise LabStartError(f"timed out after {timeout:.0f}s waiting for {what}{detail}{logs}")


def http_ok(url: str, ctx: ssl.SSLContext | None = None, expect: bytes | None = None) -> bool:
    try:
        with urllib.request.urlopen(url, context=ctx, timeout=2) as resp:
            body = resp.read()
            return resp.status == 200 and (expect is None or expect in body)
    except urllib.error.HTTPError:
        return False

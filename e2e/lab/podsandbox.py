"""One container of a process-runner pod: join its memory cgroup, mount its volumes, exec its command.

    python -m e2e.lab.podsandbox SPEC.json

Started by the process runner (podrunner.py) for each container. SPEC holds the container's
memory cgroup directory, its mounts (host path -> path in the container, read-only or not), its
working directory, argv and environment. This process

1. writes its pid into the cgroup's cgroup.procs, so everything the container starts is charged
   to the cgroup and a process that exceeds its limit is killed by the kernel's OOM killer;
2. enters a mount namespace of its own (unshare(CLONE_NEWNS), / made private), so its mounts are
   seen by the container's processes only;
3. bind-mounts each volume onto its path (sources are opened before any mount, so a mount over
   /tmp cannot hide a later source under /tmp), read-only where the pod says so;
4. changes into the working directory and execs the command with exactly the given environment
   (the container's PID "1" is then the command itself, as in a container).

It needs root (CAP_SYS_ADMIN for the mount namespace, write access to the cgroup). The network,
PID and user namespaces stay the machine's (see e2e/README.md, "What differs from a kubelet").
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import os
import sys
from pathlib import Path

CLONE_NEWNS = 0x00020000
MS_RDONLY = 0x1
MS_REMOUNT = 0x20
MS_BIND = 0x1000
MS_REC = 0x4000
MS_PRIVATE = 0x40000

_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)


def _check(result: int, what: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


def _mount(source: str | None, target: str, flags: int) -> None:
    _check(_libc.mount(source.encode() if source else None, target.encode(), None, flags, None),
           f"mount {source} on {target}")


def _ensure_mount_point(target: Path, is_dir: bool) -> None:
    # The mount point has to exist in the (shared) file system; an empty directory or file is left
    # behind on the machine, e.g. /mnt/model or /dev/termination-log.
    if target.exists():
        return
    if is_dir:
        target.mkdir(parents=True, exist_ok=True)
    else:
        target.parent.mkdir(parents=True, exist_ok=True)
        target.touch()


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m e2e.lab.podsandbox SPEC.json", file=sys.stderr)
        return 2
    spec = json.loads(Path(argv[0]).read_text())
    Path(spec["cgroup"], "cgroup.procs").write_text(str(os.getpid()))
    _check(_libc.unshare(CLONE_NEWNS), "unshare(CLONE_NEWNS)")
    _mount(None, "/", MS_REC | MS_PRIVATE)
    # Open every source before the first mount (in the new namespace: a bind source must belong
    # to it): a mount over /tmp (the pod's scratch volume) would otherwise hide sources that live
    # under /tmp on this machine.
    mounts = []
    for m in sorted(spec["mounts"], key=lambda m: len(Path(m["target"]).parts)):
        fd = os.open(m["source"], os.O_PATH | os.O_CLOEXEC)
        mounts.append((fd, m))
    for fd, m in mounts:
        target = Path(m["target"])
        _ensure_mount_point(target, os.path.isdir(f"/proc/self/fd/{fd}"))
        _mount(f"/proc/self/fd/{fd}", str(target), MS_BIND | MS_REC)
        if m.get("readOnly"):
            _mount(None, str(target), MS_BIND | MS_REMOUNT | MS_RDONLY)
        os.close(fd)
    os.chdir(spec.get("workingDir") or "/")
    env = dict(spec["env"])
    argv_ = list(spec["argv"])
    try:
        os.execvpe(argv_[0], argv_, env)
    except OSError as exc:
        # What a container runtime says when the entrypoint cannot start (exit 127 or 126).
        print(f"exec {argv_[0]!r} failed: {exc}", file=sys.stderr)
        return 127 if isinstance(exc, FileNotFoundError) else 126
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""What the operator knows of each FineTuneJob between reconciles: the newest body the watch or
its own status write showed (`JobBodies`, read instead of a GET per look), and the resourceVersion
of its own last status write (`OwnWrites`, whose watch event needs no reconcile).
"""

from __future__ import annotations

import threading
from typing import Any

from .informer import slim


class JobBodies:
    """The newest FineTuneJob each watch event or own status write showed (the FineTuneJob informer feeds it):
    a reconcile reads the job from here instead of a GET per look (at a thousand jobs, most of the
    operator's reads). A stale body is safe: every write is guarded by the body's resourceVersion,
    and creates and deletes come only after such a write, so a decision made on an old version
    fails with 409 before it acts; the job is then read from the API once (`must_read`), and every
    change brings an event that queues the job again with the newer body."""

    def __init__(self) -> None:
        self._bodies: dict[tuple[str, str], dict[str, Any]] = {}
        self._must_read: set[tuple[str, str]] = set()
        self._lock = threading.Lock()

    def seen(self, key: tuple[str, str], body: dict[str, Any] | None) -> None:
        """A watch event (None: the job was deleted) or the job as our write stored it."""
        with self._lock:
            if body is None:
                self._bodies.pop(key, None)
            elif not _older(body, self._bodies.get(key)):
                self._bodies[key] = slim(body)  # managedFields: often half the object, never read

    def get(self, key: tuple[str, str]) -> dict[str, Any] | None:
        """The body to reconcile from, or None: read the API."""
        with self._lock:
            if key in self._must_read:
                return None
            return self._bodies.get(key)

    def must_read(self, key: tuple[str, str], read: bool = True) -> None:
        with self._lock:
            if read:
                self._must_read.add(key)
            else:
                self._must_read.discard(key)


def _older(body: dict[str, Any], than: dict[str, Any] | None) -> bool:
    """Whether `body` is an older version than `than`: a watch event that arrives after the job as our
    own write stored it (read by a GET before the watch caught up). resourceVersions are opaque to
    clients; etcd's are increasing integers, and anything else is taken as newer (a stale body only
    costs a 409 and one read)."""
    if than is None:
        return False
    mine, theirs = (b.get("metadata", {}).get("resourceVersion") for b in (body, than))
    return isinstance(mine, str) and isinstance(theirs, str) and mine.isdigit() and theirs.isdigit() \
        and int(mine) < int(theirs)


class OwnWrites:
    """The resourceVersion of each job's last status the operator wrote itself. The watch event of
    that write shows the job as the reconcile that wrote it left it: reconciling it again would only
    read and compare (at a thousand jobs, one wasted reconcile per write). So does the event of an
    earlier write, which a watch delivers after the next write when two follow each other closely:
    every status write is guarded by the resourceVersion it read, so the reconcile that wrote had seen
    every change before it. A change by anyone else after it has a newer resourceVersion."""

    def __init__(self) -> None:
        self._written: dict[tuple[str, str], str] = {}
        self._lock = threading.Lock()

    def note(self, key: tuple[str, str], stored: dict[str, Any]) -> None:
        version = (stored.get("metadata") or {}).get("resourceVersion")
        with self._lock:
            if version:
                self._written[key] = version
            else:
                self._written.pop(key, None)

    def is_own(self, key: tuple[str, str], body: dict[str, Any]) -> bool:
        """Whether `body` shows nothing newer than the job as the operator's last status write stored
        it (that write, or a version before it; see `_older` for how versions compare)."""
        version = (body.get("metadata") or {}).get("resourceVersion")
        with self._lock:
            written = self._written.get(key)
        if version is None or written is None:
            return False
        return version == written or _older(body, {"metadata": {"resourceVersion": written}})

    def forget(self, key: tuple[str, str]) -> None:
        with self._lock:
            self._written.pop(key, None)

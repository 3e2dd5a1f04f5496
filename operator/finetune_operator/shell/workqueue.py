"""The work queue: each job's key reconciled by one thread at a time, delays honoured, duplicates
merged, as client-go's rate-limited delaying queue does, with two lines of ready keys.

  urgent   something happened to the job (a watch event of the job, its pods or its training
           job, a wake-up because GPUs freed up): handed out first, in arrival order;
  bulk     look-agains nobody asked for now (a resync timer came due, a new leader or a policy
           change looking at every job): handed out when no urgent key waits.

Why two: a replica that takes over the lease looks at every job it knows (hundreds), and a burst
of applied jobs comes with as many timers; in one line a job applied then waited behind all of
them (bench/scale.py: 15 s from the leader's death to the child of a job applied right after).

Ahead of both, a third line holds jobs nobody has looked at yet (applied, no status): in a burst of
a thousand applied jobs their first look (plan, create) goes before the pod and training-job events
of the jobs already started, whose looks only follow what happened.

Every operation is O(log n): ready keys sit in deques, delayed ones in a heap whose stale entries
(a key re-added sooner, or handed out meanwhile) are skipped when they reach its top.
"""

from __future__ import annotations

import heapq
import logging
import random
import threading
import time
from collections import deque
from typing import Callable

import urllib3
from kubernetes.client.rest import ApiException

log = logging.getLogger("finetune_operator.workqueue")

Key = tuple[str, str]
FIRST, URGENT, BULK = 0, 1, 2

# Retries of a reconcile that met a transient error.
BASE_BACKOFF_SECONDS = 0.5
MAX_BACKOFF_SECONDS = 30.0
# What a dead or restarting API server looks like to the client.
TRANSIENT_ERRORS: tuple[type[BaseException], ...] = (urllib3.exceptions.HTTPError, ConnectionError, TimeoutError)


class WorkQueue:
    """Keys to reconcile, each worked on by one thread at a time, some after a delay."""

    def __init__(self, handle: Callable[[Key], float | None], workers: int = 4,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._handle = handle
        # Due times are read from this clock (injected so that tests move time instead of sleeping);
        # waits on the condition variable stay in real seconds.
        self._clock = clock
        self._lines: tuple[deque[Key], ...] = (deque(), deque(), deque())
        self._ready: dict[Key, int] = {}  # key -> the line it waits in (its entries elsewhere are stale)
        self._heap: list[tuple[float, int, Key, int]] = []  # (due, counter, key, line)
        self._due: dict[Key, tuple[float, int]] = {}  # the earliest (due, line) of each delayed key
        self._busy: set[Key] = set()
        self._again: dict[Key, int] = {}  # busy keys added meanwhile: ready again when their reconcile ends
        self._counter = 0
        self._cv = threading.Condition()
        self._stopped = False
        self._active = True  # False while another replica leads: keys wait, nothing is reconciled
        self._failures: dict[Key, int] = {}
        self._threads = [threading.Thread(target=self._work, name=f"reconcile-{i}", daemon=True) for i in range(workers)]

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def dead(self) -> list[str]:
        """The worker threads that ended while the queue runs (an error escaped a worker): the
        liveness probe fails on them, since their keys would never be handed out again."""
        with self._cv:
            if self._stopped:
                return []
        return [t.name for t in self._threads if t.ident is not None and not t.is_alive()]

    def stop(self) -> None:
        with self._cv:
            self._stopped = True
            self._cv.notify_all()
        for thread in self._threads:
            thread.join(timeout=10)

    def _backoff(self, key: Key) -> float:
        """Exponential backoff per key with full jitter, like client-go's rate limiter: 0.5 s
        doubling to 30 s, so an API-server restart is not hammered by every job at once."""
        failures = self._failures[key] = self._failures.get(key, 0) + 1
        ceiling = min(MAX_BACKOFF_SECONDS, BASE_BACKOFF_SECONDS * 2 ** (failures - 1))
        return ceiling / 2 + random.uniform(0, ceiling / 2)

    def set_active(self, active: bool) -> None:
        """Hand out keys (this replica leads) or hold them (it does not)."""
        with self._cv:
            self._active = active
            self._cv.notify_all()

    @property
    def active(self) -> bool:
        with self._cv:
            return self._active

    def wait_idle(self, timeout: float) -> bool:
        """Wait until no reconcile is running; False when `timeout` passed first."""
        deadline = self._clock() + timeout
        with self._cv:
            while self._busy:
                left = deadline - self._clock()
                if left <= 0:
                    return False
                self._cv.wait(timeout=left)
            return True

    def __len__(self) -> int:
        """Keys waiting (ready, delayed or to run again), not counting those being reconciled."""
        with self._cv:
            return len(set(self._ready) | set(self._due) | set(self._again))

    def add(self, key: Key, delay: float = 0.0, *, urgent: bool = True, first: bool = False) -> None:
        """Queue `key` now (`urgent`: ahead of the bulk line; `first`: a job never looked at, ahead of
        both) or after `delay` seconds (it joins the bulk line then). A key already waiting keeps its
        earliest time and its best line."""
        line = BULK if delay > 0 or not (urgent or first) else FIRST if first else URGENT
        with self._cv:
            if delay > 0:
                when = self._clock() + delay
                if key in self._ready or key in self._again:
                    return  # due now anyway
                current = self._due.get(key)
                if current is not None and current[0] <= when:
                    return  # already due sooner
                self._due[key] = (when, line)
                self._counter += 1
                heapq.heappush(self._heap, (when, self._counter, key, line))
                self._cv.notify()
                return
            self._make_ready(key, line)
            self._cv.notify()

    def _make_ready(self, key: Key, line: int) -> None:
        """(Under the lock.) Put the key in a ready line, or mark it to run again when it is busy."""
        if key in self._busy:
            self._again[key] = min(line, self._again.get(key, line))
            return
        current = self._ready.get(key)
        if current is not None and current <= line:
            return  # already waiting in this line or a better one
        self._ready[key] = line
        self._lines[line].append(key)
        self._due.pop(key, None)  # a delayed entry for it is stale now

    def _promote_due(self, now: float) -> float | None:
        """(Under the lock.) Move delayed keys that are due into the ready lines; returns the time
        the next delayed key is due (None: none)."""
        while self._heap:
            when, _, key, line = self._heap[0]
            if self._due.get(key) != (when, line):
                heapq.heappop(self._heap)  # stale: re-added sooner, or made ready meanwhile
                continue
            if when > now:
                return when
            heapq.heappop(self._heap)
            del self._due[key]
            self._make_ready(key, line)
        return None

    def _take(self) -> tuple[Key | None, float | None]:
        """(Under the lock.) Hand out the next ready key, best line first, marking it busy; else
        None and the time the next delayed key is due (None: none is delayed)."""
        next_due = self._promote_due(self._clock())
        for line in (FIRST, URGENT, BULK):
            waiting = self._lines[line]
            while waiting:
                key = waiting.popleft()
                if self._ready.get(key) != line:
                    continue  # stale: promoted to the urgent line, or already handed out
                del self._ready[key]
                self._busy.add(key)
                return key, None
        return None, next_due

    def take_ready(self) -> Key | None:
        """The next ready key without waiting (None when none is ready): `_next` without the wait,
        for a caller that drives the queue itself."""
        with self._cv:
            return self._take()[0] if self._active else None

    def _next(self) -> Key | None:
        with self._cv:
            while not self._stopped:
                if not self._active:
                    self._cv.wait(timeout=1.0)
                    continue
                key, next_due = self._take()
                if key is not None:
                    return key
                self._cv.wait(timeout=(next_due - self._clock()) if next_due is not None else 1.0)
            return None

    def _done(self, key: Key, delay: float | None) -> None:
        with self._cv:
            self._busy.discard(key)
            again = self._again.pop(key, None)
            if again is not None:
                self._make_ready(key, again)
            self._cv.notify_all()
        if delay is not None and again is None:
            self.add(key, delay, urgent=delay <= 0)

    def _work(self) -> None:
        while True:
            key = self._next()
            if key is None:
                return
            delay: float | None = None
            try:
                delay = self._handle(key)
                self._failures.pop(key, None)
            except ApiException as error:
                if error.status == 409:  # the job changed under us: read it again now
                    delay = 0.0
                else:
                    delay = self._backoff(key)
                    log.warning("reconcile %s/%s: API error %s %s; retrying in %.1f s", *key, error.status, error.reason, delay)
            except TRANSIENT_ERRORS as error:
                # The API server is away (a restart, a network blip): one line, not a traceback.
                delay = self._backoff(key)
                log.warning("reconcile %s/%s: API unreachable (%s); retrying in %.1f s", *key,
                            type(error).__name__, delay)
            except Exception:  # a bug must not kill the worker; the job is retried with backoff
                log.exception("reconcile %s/%s failed; retrying", *key)
                delay = 30.0
            self._done(key, delay)

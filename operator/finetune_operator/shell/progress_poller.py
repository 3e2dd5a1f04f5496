"""Training progress from the trainer's log: the shell.

A background thread reads the tail of each running job's rank-0 pod log through the API
(`pods/log`: the training pods need no API rights, and the API server's log endpoint works
on any cluster) and writes `status.progress`. Where the attempt is a TrainJob whose
status.trainerStatus (Kubeflow Trainer's TrainJobStatus gate) holds a newer report of our
trainer, that report is taken from the informer's memory instead and the log is not read. It is kept off the reconcile path on purpose:

* the reconciler only tells it, from memory, which pod is rank 0 of the current attempt
  (`track`, after each reconcile; no I/O), and a status it writes keeps only the current
  attempt's progress (`progress.for_status`);
* reads are bounded: each job at most every `interval` seconds, at most `max_reads_per_second`
  reads for all jobs together on `workers` threads, and each read asks for at most
  `tail_lines` lines and `limit_bytes` bytes written since the last read;
* a read or write that fails or is slow changes nothing but the progress shown: no decision
  of the lifecycle depends on it;
* its write is a JSON patch of `status.progress` that first tests `status.currentAttempt`, so
  it never lands on a job whose attempt moved on, and never overwrites the reconciler's fields;
* the event of that write does not wake a reconcile (`ProgressOnlyChanges`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Protocol

from kubernetes.client.rest import ApiException

from .. import api
from finetune_trainer.contract import progress_from_trainer_status

from ..progress import JobProgress, RateEstimate, Target
from .apiclient import LOG_READ_TIMEOUT

log = logging.getLogger("finetune_operator.progress")

DEFAULT_INTERVAL_SECONDS = 20.0
DEFAULT_WORKERS = 2
DEFAULT_READS_PER_SECOND = 5.0
# The loop looks for due jobs this often, and whenever a read ends (a free worker).
LOOP_SECONDS = 0.2
# A progress line is ~400 bytes; the tail also holds warnings and the odd traceback.
DEFAULT_TAIL_LINES = 64
DEFAULT_LIMIT_BYTES = 64 * 1024
# Lines written just before the last read may arrive a little later; read a bit further back.
SINCE_MARGIN_SECONDS = 10
# A job whose log cannot be read is read again after the interval, doubling with each failure up to
# this (a pod whose container has not started yet is refused for a moment; an RBAC gap for good).
ERROR_BACKOFF_SECONDS = 120.0
Key = tuple[str, str]


class LogSource(Protocol):
    def __call__(self, target: Target, since_seconds: int | None, tail_lines: int, limit_bytes: int) -> str: ...


class TrainerStatusSource(Protocol):
    """The current attempt's TrainJob status.trainerStatus from the informer's memory (no API
    request), or None: another backend, not informed, or not reported."""
    def __call__(self, target: Target) -> Any: ...


class ProgressSink(Protocol):
    def __call__(self, target: Target, progress: api.ProgressStatus) -> None: ...


def read_pod_log(core: Any) -> LogSource:
    """The log tail through CoreV1Api (GET .../pods/<pod>/log)."""
    def read(target: Target, since_seconds: int | None, tail_lines: int, limit_bytes: int) -> str:
        kwargs: dict[str, Any] = {"container": target.container, "tail_lines": tail_lines, "limit_bytes": limit_bytes,
                                  "_preload_content": False,
                                  "_request_timeout": LOG_READ_TIMEOUT.as_request_timeout()}
        if since_seconds is not None:
            kwargs["since_seconds"] = since_seconds
        response = core.read_namespaced_pod_log(target.pod, target.namespace, **kwargs)
        return response.data.decode("utf-8", errors="replace")
    return read


def patch_progress(custom: Any) -> ProgressSink:
    """Write status.progress as a JSON patch that tests status.currentAttempt first."""
    def write(target: Target, progress: api.ProgressStatus) -> None:
        value = progress.model_dump(mode="json", by_alias=True, exclude_none=True)
        custom.patch_namespaced_custom_object_status(
            api.GROUP, api.VERSION, target.namespace, api.PLURAL, target.job,
            [{"op": "test", "path": "/status/currentAttempt", "value": target.attempt},
             {"op": "add", "path": "/status/progress", "value": value}],
            _content_type="application/json-patch+json")
    return write


@dataclass
class PollerSettings:
    interval: float = DEFAULT_INTERVAL_SECONDS
    workers: int = DEFAULT_WORKERS
    max_reads_per_second: float = DEFAULT_READS_PER_SECOND
    tail_lines: int = DEFAULT_TAIL_LINES
    limit_bytes: int = DEFAULT_LIMIT_BYTES


class ProgressPoller:
    def __init__(self, read: LogSource, write: ProgressSink, settings: PollerSettings | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 trainer_status: TrainerStatusSource | None = None) -> None:
        self.read, self.write, self.trainer_status = read, write, trainer_status
        self.settings = settings or PollerSettings()
        self.clock = clock
        self._lock = threading.Lock()
        self._targets: dict[Key, Target] = {}
        self._jobs: dict[Key, JobProgress] = {}
        self._due: dict[Key, float] = {}
        self._last_read: dict[Key, float] = {}
        self._busy: set[Key] = set()
        self._failures: dict[Key, int] = {}  # reads in a row that failed, per job
        self._reads: deque[float] = deque()  # start times of recent reads, for the global rate
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._pool: ThreadPoolExecutor | None = None
        self.stats = {"reads": 0, "read_errors": 0, "writes": 0, "write_errors": 0, "trainer_status": 0}

    # -- what the reconciler tells it (memory only) -----------------------------------
    def track(self, key: Key, target: Target | None) -> None:
        """The job's log to follow now (None: nothing to read). A new attempt starts afresh; a
        target that ended is read once more, then dropped."""
        with self._lock:
            if target is None:
                self._targets.pop(key, None)
                self._due.pop(key, None)
                return
            previous = self._targets.get(key)
            job = self._jobs.get(key)
            if job is None or job.attempt != target.attempt:
                self._jobs[key] = JobProgress(attempt=target.attempt, rate=RateEstimate())
                self._last_read.pop(key, None)
            if previous is not None and previous.pod != target.pod:
                self._last_read.pop(key, None)  # another pod: read its whole tail
            self._targets[key] = target
            if previous is None or previous.pod != target.pod or (target.ended and not previous.ended):
                self._due[key] = self.clock()  # read now: a new pod, or the final line of an ended one
                self._wake.set()
            else:
                self._due.setdefault(key, self.clock())

    def forget(self, key: Key) -> None:
        with self._lock:
            for table in (self._targets, self._jobs, self._due, self._last_read, self._failures):
                table.pop(key, None)

    def clear(self) -> None:
        """Stop following every job (this replica no longer leads)."""
        with self._lock:
            self._targets.clear()
            self._due.clear()

    def tracked(self) -> dict[Key, Target]:
        with self._lock:
            return dict(self._targets)

    # -- the loop ----------------------------------------------------------------------
    def start(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=max(1, self.settings.workers), thread_name_prefix="progress")
        self._thread = threading.Thread(target=self._run, name="progress", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            for key in self.due_now():
                assert self._pool is not None
                self._pool.submit(self.poll, key)
            self._wake.wait(timeout=LOOP_SECONDS)
            self._wake.clear()

    def due_now(self) -> list[Key]:
        """The jobs to read now, marked busy: due, not being read, within the global read rate."""
        now = self.clock()
        picked: list[Key] = []
        with self._lock:
            while self._reads and now - self._reads[0] >= 1.0:
                self._reads.popleft()
            budget = max(0, int(self.settings.max_reads_per_second) - len(self._reads))
            busy_budget = max(0, self.settings.workers - len(self._busy))
            for key, due in sorted(self._due.items(), key=lambda item: item[1]):
                if len(picked) >= min(budget, busy_budget):
                    break
                if due > now or key in self._busy:
                    continue
                self._busy.add(key)
                self._reads.append(now)
                picked.append(key)
        return picked

    def poll(self, key: Key) -> None:
        """Read one job's log tail and write its progress if it moved. Never raises."""
        try:
            self._poll(key)
        except Exception:  # noqa: BLE001 - progress is best effort; the reconciler does not depend on it
            log.exception("progress of %s/%s", *key)
        finally:
            with self._lock:
                self._busy.discard(key)
            self._wake.set()  # a worker is free: hand out the next due job now

    def _poll(self, key: Key) -> None:
        with self._lock:
            target, job = self._targets.get(key), self._jobs.get(key)
            if target is None or job is None:
                return
            started = self.clock()
            last = self._last_read.get(key)
            self._due[key] = started + self.settings.interval
        progress = None if target.ended else self._from_trainer_status(key, target)
        if progress is not None:
            self._write(key, target, progress)
            return
        with self._lock:
            self.stats["reads"] += 1
        since = None if last is None else int(started - last) + SINCE_MARGIN_SECONDS
        try:
            text = self.read(target, since, self.settings.tail_lines, self.settings.limit_bytes)
        except (ApiException, OSError, ValueError) as error:
            with self._lock:
                self.stats["read_errors"] += 1
                failures = self._failures[key] = self._failures.get(key, 0) + 1
                if self._targets.get(key) == target:
                    if target.ended:  # the final read of a finished pod: no second try
                        self._targets.pop(key, None)
                        self._due.pop(key, None)
                    else:
                        backoff = min(ERROR_BACKOFF_SECONDS, self.settings.interval * 2 ** (failures - 1))
                        self._due[key] = started + max(self.settings.interval, backoff)
            # Said once per run of failures (a missing pods/log rule must be visible), then quietly.
            (log.warning if failures == 1 else log.debug)(
                "progress of %s/%s: cannot read the log of pod %s: %s", *key, target.pod, _reason(error))
            return
        with self._lock:
            if self._targets.get(key) != target:
                return  # the attempt or pod changed while we read
            self._last_read[key] = started
            self._failures.pop(key, None)
            progress = job.read(text)
            if target.ended:  # that was the final read of a finished pod
                self._targets.pop(key, None)
                self._due.pop(key, None)
        if progress is None:
            return
        self._write(key, target, progress)

    def _from_trainer_status(self, key: Key, target: Target) -> api.ProgressStatus | None:
        """A newer report from the TrainJob's trainerStatus, taken in; None: read the log instead
        (no source, nothing reported, or nothing newer: the trainer's POSTs may have stopped)."""
        if self.trainer_status is None:
            return None
        try:
            report = progress_from_trainer_status(self.trainer_status(target))
        except Exception:  # noqa: BLE001 - a cache lookup must not stop the log path
            log.exception("progress of %s/%s: reading trainerStatus", *key)
            return None
        with self._lock:
            job = self._jobs.get(key)
            if report is None or job is None or self._targets.get(key) != target:
                return None
            progress = job.take(report)
            if progress is not None:
                self.stats["trainer_status"] += 1
            return progress

    def _write(self, key: Key, target: Target, progress: api.ProgressStatus) -> None:
        try:
            self.write(target, progress)
            outcome = "writes"
        except ApiException as error:
            # 422: the test of currentAttempt failed (the job moved on); 404: it is gone.
            outcome = "write_errors"
            log.debug("progress of %s/%s not written: %s", *key, _reason(error))
        except (OSError, ValueError) as error:
            outcome = "write_errors"
            log.debug("progress of %s/%s not written: %s", *key, error)
        with self._lock:
            self.stats[outcome] += 1


def _reason(error: BaseException) -> str:
    if isinstance(error, ApiException):
        return f"{error.status} {error.reason}"
    return str(error)


class ProgressOnlyChanges:
    """Tells whether a FineTuneJob watch event changes anything but status.progress, so the
    progress writes (every `interval` per running job) do not each wake a reconcile."""

    def __init__(self) -> None:
        self._seen: dict[Key, str] = {}
        self._lock = threading.Lock()

    @staticmethod
    def fingerprint(body: dict[str, Any]) -> str:
        meta = {k: v for k, v in (body.get("metadata") or {}).items() if k not in ("resourceVersion", "managedFields")}
        status = body.get("status")
        if isinstance(status, dict):
            status = {k: v for k, v in status.items() if k != "progress"}
        rest = {k: v for k, v in body.items() if k not in ("metadata", "status")}
        text = json.dumps([meta, status, rest], sort_keys=True, default=str)
        return hashlib.sha256(text.encode()).hexdigest()

    def only_progress(self, key: Key, body: dict[str, Any]) -> bool:
        """True when nothing but status.progress (or nothing at all) changed since the last event."""
        fingerprint = self.fingerprint(body)
        with self._lock:
            same = self._seen.get(key) == fingerprint
            self._seen[key] = fingerprint
            return same

    def forget(self, key: Key) -> None:
        with self._lock:
            self._seen.pop(key, None)

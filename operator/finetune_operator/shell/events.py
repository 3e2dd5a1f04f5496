"""Events off the reconcile path, as client-go's broadcaster sends them: a reconcile hands its
Events to one background thread and goes on; the thread posts them in order (Cluster.post_event,
which aggregates repeats into one object with a count).

Why: an Event is one more API round trip per decision, and a reconcile that waits for it holds a
worker that a thousand freshly applied jobs are waiting for (bench/scale.py). Like client-go's, the
line is bounded: when the API server is so slow that it fills, further Events are dropped and
counted (finetune_events_dropped_total), never the reconcile blocked; what the Events say is in
the job's status conditions as well.
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Any, Callable

from . import metrics
from ..lifecycle import Event

log = logging.getLogger("finetune_operator.events")

CAPACITY = 1000  # client-go's broadcaster queues 1000 too


class EventRecorder:
    def __init__(self, post: Callable[[dict[str, Any], Event], None], capacity: int = CAPACITY) -> None:
        self._post = post
        self._line: queue.Queue[tuple[dict[str, Any], Event] | None] = queue.Queue(maxsize=capacity)
        self._thread = threading.Thread(target=self._run, name="events", daemon=True)
        self.dropped = 0

    def start(self) -> "EventRecorder":
        self._thread.start()
        return self

    def record(self, job_body: dict[str, Any], event: Event) -> None:
        """Post `event` about the job soon; never blocks."""
        try:
            self._line.put_nowait((job_body, event))
        except queue.Full:
            self.dropped += 1
            metrics.EVENTS_DROPPED.inc()
            if self.dropped in (1, 10, 100) or self.dropped % 1000 == 0:
                log.warning("%d events dropped: the API server is not keeping up (the job's conditions say the same)",
                            self.dropped)

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until every recorded event was posted (or failed); False when `timeout` passed."""
        done = threading.Event()

        def waiter() -> None:
            self._line.join()
            done.set()

        threading.Thread(target=waiter, daemon=True).start()
        return done.wait(timeout)

    def stop(self, timeout: float = 5.0) -> None:
        """Post what is queued (for at most `timeout` seconds), then end the thread."""
        self.flush(timeout)
        try:
            self._line.put_nowait(None)
        except queue.Full:
            pass

    def _run(self) -> None:
        while True:
            item = self._line.get()
            try:
                if item is None:
                    return
                try:
                    self._post(*item)
                except Exception as error:  # best effort, as Events are; never let the thread die
                    log.warning("could not post event %s: %r", item[1].reason, error)
            finally:
                self._line.task_done()

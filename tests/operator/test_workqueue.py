"""The work queue: one reconcile per job at a time, delays honoured, duplicates merged."""

from __future__ import annotations

import threading
import time

from finetune_operator.controller import WorkQueue


def _run(queue: WorkQueue, seconds: float) -> None:
    queue.start()
    time.sleep(seconds)
    queue.stop()


def test_the_same_key_never_runs_twice_at_once():
    running: dict[tuple[str, str], int] = {}
    overlaps: list[tuple[str, str]] = []
    calls: list[tuple[str, str]] = []
    lock = threading.Lock()

    def handle(key):
        with lock:
            running[key] = running.get(key, 0) + 1
            if running[key] > 1:
                overlaps.append(key)
            calls.append(key)
        time.sleep(0.05)
        with lock:
            running[key] -= 1
        return None

    queue = WorkQueue(handle, workers=4)
    queue.start()
    for _ in range(20):
        queue.add(("ns", "a"))
        queue.add(("ns", "b"))
        time.sleep(0.005)
    time.sleep(0.5)
    queue.stop()
    assert overlaps == []
    assert 1 <= calls.count(("ns", "a")) < 20  # merged, yet an add while busy is not lost
    assert calls.count(("ns", "b")) >= 1


def test_requeue_after_is_honoured():
    times: list[float] = []

    def handle(key):
        times.append(time.monotonic())
        return 0.3 if len(times) < 3 else None

    queue = WorkQueue(handle, workers=2)
    queue.add(("ns", "job"))
    _run(queue, 1.2)
    assert len(times) == 3
    assert times[1] - times[0] >= 0.28 and times[2] - times[1] >= 0.28


def test_an_earlier_add_wins_over_a_later_delay():
    times: list[float] = []
    queue = WorkQueue(lambda key: times.append(time.monotonic()), workers=1)
    start = time.monotonic()
    queue.add(("ns", "job"), delay=5.0)
    queue.add(("ns", "job"), delay=0.1)
    _run(queue, 0.6)
    assert len(times) == 1 and times[0] - start < 0.5


def test_a_failing_reconcile_is_retried_not_fatal():
    calls: list[str] = []

    def handle(key):
        calls.append(key[1])
        if key[1] == "bad":
            raise RuntimeError("boom")
        return None

    queue = WorkQueue(handle, workers=1)
    queue.start()
    queue.add(("ns", "bad"))
    time.sleep(0.2)
    queue.add(("ns", "good"))  # the single worker survived the exception
    time.sleep(0.3)
    queue.stop()
    assert calls == ["bad", "good"]  # "bad" is retried only after its 30 s backoff


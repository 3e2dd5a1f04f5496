"""The work queue: one reconcile per job at a time, delays honoured, duplicates merged."""

from __future__ import annotations

import threading
import time

from finetune_operator.workqueue import WorkQueue


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



class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


def _queue_on(clock, monkeypatch) -> WorkQueue:
    """A queue with no worker threads, on a clock the test moves: _next/_done are called by hand."""
    import finetune_operator.workqueue as wq

    monkeypatch.setattr(wq, "time", clock)
    return WorkQueue(lambda key: None, workers=0)


def test_a_job_that_something_happened_to_goes_before_every_look_again(monkeypatch):
    """A new leader queues every known job as a look-again; a job applied meanwhile (its event is
    urgent) is handed out first, and the look-agains then in the order they came."""
    queue = _queue_on(_Clock(), monkeypatch)
    for i in range(300):
        queue.add(("ns", f"known-{i}"), urgent=False)
    queue.add(("ns", "new"))
    assert queue._next() == ("ns", "new")
    assert [queue._next() for _ in range(3)] == [("ns", "known-0"), ("ns", "known-1"), ("ns", "known-2")]
    # A look-again that something then happens to is promoted, and handed out once.
    queue.add(("ns", "known-200"))
    assert queue._next() == ("ns", "known-200")
    handed = [queue._next() for _ in range(296)]
    assert ("ns", "known-200") not in handed and len(set(handed)) == 296 and len(queue) == 0


def test_a_delayed_key_is_a_look_again_when_due_and_a_busy_key_runs_again_after(monkeypatch):
    clock = _Clock()
    queue = _queue_on(clock, monkeypatch)
    queue.add(("ns", "timer"), delay=5)
    queue.add(("ns", "timer"), delay=9)  # later: the earlier time stays
    queue.add(("ns", "busy"))
    assert queue._next() == ("ns", "busy")
    queue.add(("ns", "busy"))  # while busy: not handed out twice at once ...
    clock.now += 5
    queue.add(("ns", "event"))
    assert queue._next() == ("ns", "event")  # urgent before the timer that came due
    assert queue._next() == ("ns", "timer")
    assert len(queue) == 1  # ... but kept
    queue._done(("ns", "busy"), delay=30)
    assert queue._next() == ("ns", "busy")  # ... and ready again once its reconcile ended
    queue._done(("ns", "busy"), delay=None)
    assert len(queue) == 0


def test_random_adds_hand_out_every_key_once_urgent_first(monkeypatch):
    import random

    rng = random.Random(5)
    for _ in range(50):
        clock = _Clock()
        queue = _queue_on(clock, monkeypatch)
        urgent, bulk = set(), set()
        for _ in range(rng.randint(1, 60)):
            key = ("ns", f"j{rng.randint(0, 25)}")
            if rng.random() < 0.3:
                queue.add(key, delay=rng.choice([1.0, 3.0]))
                if key not in urgent:
                    bulk.add(key)
            elif rng.random() < 0.5:
                queue.add(key)
                urgent.add(key)
                bulk.discard(key)
            else:
                queue.add(key, urgent=False)
                if key not in urgent:
                    bulk.add(key)
        clock.now += 10
        handed = [queue._next() for _ in range(len(urgent | bulk))]
        assert len(handed) == len(set(handed)) and set(handed) == urgent | bulk
        assert set(handed[:len(urgent)]) == urgent
        assert len(queue) == 0


def test_a_job_never_looked_at_goes_before_events_of_started_jobs(monkeypatch):
    queue = _queue_on(_Clock(), monkeypatch)
    for i in range(50):
        queue.add(("ns", f"started-{i}"))  # pod and training-job events
    queue.add(("ns", "timer"), urgent=False)
    queue.add(("ns", "applied"), first=True)
    queue.add(("ns", "started-7"), first=True)  # promoted, handed out once
    assert queue._next() == ("ns", "applied") and queue._next() == ("ns", "started-7")
    handed = [queue._next() for _ in range(50)]
    assert handed[-1] == ("ns", "timer") and ("ns", "started-7") not in handed and len(queue) == 0

"""The work queue: one reconcile per job at a time, delays honoured, duplicates merged."""

from __future__ import annotations

import threading
import time

from finetune_operator.shell.workqueue import WorkQueue


def _wait_for(condition, timeout: float = 20.0) -> None:
    """Wait until `condition()` holds; the timeout only bounds a failing test, it is no window the
    queue must meet (a loaded CI machine may take its time)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "the queue did not get there"
        time.sleep(0.005)


def test_the_same_key_never_runs_twice_at_once():
    """Adds of a key that is being reconciled are merged into one more reconcile after it, never a
    second one beside it, while another key goes on meanwhile (four real worker threads)."""
    running: dict[tuple[str, str], int] = {}
    overlaps: list[tuple[str, str]] = []
    calls: list[tuple[str, str]] = []
    lock = threading.Lock()
    release = threading.Event()

    def handle(key):
        with lock:
            running[key] = running.get(key, 0) + 1
            if running[key] > 1:
                overlaps.append(key)
            calls.append(key)
        if key == ("ns", "a") and calls.count(key) == 1:
            release.wait(timeout=20)  # the first reconcile of "a" is held until every add is in
        with lock:
            running[key] -= 1
        return None

    queue = WorkQueue(handle, workers=4)
    queue.start()
    queue.add(("ns", "a"))
    _wait_for(lambda: calls.count(("ns", "a")) == 1)
    for _ in range(20):
        queue.add(("ns", "a"))  # busy: merged into one run after this one
        queue.add(("ns", "b"))
    _wait_for(lambda: ("ns", "b") in calls)  # another key is not held up by the busy one
    release.set()
    _wait_for(lambda: calls.count(("ns", "a")) == 2 and len(queue) == 0)
    assert queue.wait_idle(timeout=20)
    queue.stop()
    assert overlaps == []
    assert calls.count(("ns", "a")) == 2  # merged, yet an add while busy is not lost


def test_requeue_after_is_honoured():
    """A reconcile's requeue-after makes the key due that much later on the queue's clock, not sooner."""
    clock = _Clock()
    queue = WorkQueue(lambda key: None, workers=0, clock=clock.monotonic)
    queue.add(("ns", "job"))
    for _ in range(3):
        assert queue.take_ready() == ("ns", "job")
        queue._done(("ns", "job"), delay=0.3)
        clock.now += 0.29
        assert queue.take_ready() is None  # not due yet
        clock.now += 0.01
    assert queue.take_ready() == ("ns", "job")
    queue._done(("ns", "job"), delay=None)  # no requeue: gone
    clock.now += 100
    assert queue.take_ready() is None and len(queue) == 0


def test_an_earlier_add_wins_over_a_later_delay():
    clock = _Clock()
    queue = WorkQueue(lambda key: None, workers=0, clock=clock.monotonic)
    queue.add(("ns", "job"), delay=5.0)
    queue.add(("ns", "job"), delay=0.1)
    queue.add(("ns", "job"), delay=3.0)  # later than the one waiting: changes nothing
    clock.now += 0.1
    assert queue.take_ready() == ("ns", "job")
    queue._done(("ns", "job"), delay=None)
    clock.now += 10
    assert queue.take_ready() is None  # the stale 5 s and 3 s entries hand out nothing


def test_a_failing_reconcile_is_retried_not_fatal():
    """An exception in a reconcile neither kills the worker nor drops the key: it is retried after
    a 30 s backoff (on the queue's clock), and the worker goes on with the next key."""
    clock = _Clock()
    calls: list[str] = []

    def handle(key):
        calls.append(key[1])
        if key[1] == "bad":
            raise RuntimeError("boom")
        return None

    queue = WorkQueue(handle, workers=1, clock=clock.monotonic)
    queue.start()
    queue.add(("ns", "bad"))
    _wait_for(lambda: calls == ["bad"] and len(queue) == 1)  # failed, and waiting for its retry
    queue.add(("ns", "good"))  # the single worker survived the exception
    _wait_for(lambda: calls == ["bad", "good"])
    assert queue.wait_idle(timeout=20)
    assert queue._due[("ns", "bad")][0] == clock.now + 30.0
    queue.stop()
    assert calls == ["bad", "good"]


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


def _queue_on(clock, monkeypatch) -> WorkQueue:
    """A queue with no worker threads, on a clock the test moves: _next/_done are called by hand."""
    return WorkQueue(lambda key: None, workers=0, clock=clock.monotonic)


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

"""Events off the reconcile path (events.py): in order, never blocking, dropped and counted when full."""

from __future__ import annotations

import threading

from finetune_operator.shell.events import EventRecorder
from finetune_operator.lifecycle import Event


def test_events_are_posted_in_order_by_one_thread():
    posted: list[str] = []
    recorder = EventRecorder(lambda body, event: posted.append(event.reason)).start()
    for i in range(50):
        recorder.record({"metadata": {"name": "job"}}, Event("Normal", f"R{i}", "m"))
    assert recorder.flush(5)
    assert posted == [f"R{i}" for i in range(50)]
    recorder.stop()


def test_a_full_line_drops_and_counts_instead_of_blocking_and_a_failing_post_is_survived():
    release, taken = threading.Event(), threading.Event()
    posted: list[str] = []

    def post(body, event):
        taken.set()
        release.wait(5)
        if event.reason == "Boom":
            raise RuntimeError("the API server is away")
        posted.append(event.reason)

    recorder = EventRecorder(post, capacity=2).start()
    recorder.record({}, Event("Normal", "Boom", "m"))
    assert taken.wait(5)  # the thread holds Boom; A and B fill the line
    for reason in ("A", "B", "C", "D"):
        recorder.record({}, Event("Normal", reason, "m"))
    assert recorder.dropped == 2  # C and D (never a block: record returned at once)
    release.set()
    assert recorder.flush(5)
    assert posted[:2] == ["A", "B"]
    recorder.record({}, Event("Normal", "E", "m"))  # the thread survived the failing post
    assert recorder.flush(5) and posted[-1] == "E"
    recorder.stop()

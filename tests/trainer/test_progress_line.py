"""The trainer's progress line: written by the trainer, read by the operator from the pod log.

Both sides use finetune_trainer.contract (ProgressReport, parse_progress_line, last_progress).
"""

import json
import math
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from finetune_trainer.contract import (
    PROGRESS_LINE_LIMIT,
    ProgressReport,
    last_progress,
    parse_progress_line,
)


def report(step: int = 3, **fields) -> ProgressReport:
    base = dict(time=1_700_000_000.5, attempt=2, step=step, maxSteps=10, startStep=0, elapsedSeconds=12.5,
                loss=1.25, tokensPerSecond=812.5)
    base.update(fields)
    return ProgressReport(**base)


def test_line_round_trips_and_is_one_json_object_with_the_marker():
    line = report().to_log_line()
    assert "\n" not in line
    data = json.loads(line)
    assert data["event"] == "progress" and data["maxSteps"] == 10 and data["tokensPerSecond"] == 812.5
    assert "learningRate" not in data  # None fields are left out
    assert parse_progress_line(line) == report()


def test_nan_loss_survives_the_line():
    parsed = parse_progress_line(report(loss=float("nan")).to_log_line())
    assert parsed is not None and math.isnan(parsed.loss)


@pytest.mark.parametrize("line", [
    "",
    "Traceback (most recent call last):",
    '{"event": "summary", "step": 3, "maxSteps": 10, "time": 1.0}',
    '{"event": "progress", "step": 3',  # cut in the middle
    '{"event": "progress", "step": -1, "maxSteps": 10, "time": 1.0}',  # invalid value
    '{"event": "progress", "step": 3, "time": 1.0}',  # no total
    '{"event": "progress", "step": 3, "maxSteps": 10, "startStep": 4, "time": 1.0}',  # resumed after itself
    '["progress"]',
    '{"event": "progress", "step": 3, "maxSteps": 10, "time": 1.0, "pad": "' + "x" * PROGRESS_LINE_LIMIT + '"}',
])
def test_what_is_not_a_progress_line(line):
    assert parse_progress_line(line) is None


def test_prefix_before_the_object_and_unknown_keys_are_tolerated():
    line = "[default0]:" + json.dumps({**json.loads(report().to_log_line()), "fromANewerTrainer": 1})
    assert parse_progress_line(line) == report()


def test_last_valid_line_of_a_tail_wins():
    tail = "\n".join([report(step=1).to_log_line(), "warning: something", report(step=2).to_log_line(),
                      '{"event": "checkpoint", "step": 2}', report(step=3).to_log_line()[:40]])
    assert last_progress(tail).step == 2
    assert last_progress("no progress here\n") is None


lines = st.one_of(
    st.text(max_size=60).map(lambda t: t.replace("\n", " ")),
    st.builds(lambda s: report(step=s).to_log_line(), st.integers(0, 10)),
    st.builds(lambda s, cut: report(step=s).to_log_line()[:cut], st.integers(0, 10), st.integers(0, 80)),
)


@settings(max_examples=150, deadline=None)
@given(st.lists(lines, max_size=12), st.integers(0, 10), st.integers(0, 400))
def test_any_tail_gives_the_last_complete_report(garbage, last_step, cut):
    """Whatever precedes it, the last complete report is found; a partial last line is skipped."""
    full = report(step=last_step).to_log_line()
    tail = "\n".join(garbage + [full])
    assert last_progress(tail) == report(step=last_step)
    cut_tail = tail + "\n" + report(step=10).to_log_line()[:cut]
    expected = report(step=10) if cut >= len(report(step=10).to_log_line()) else report(step=last_step)
    assert last_progress(cut_tail) == expected


def test_trainer_callback_writes_a_line_the_operator_parses(capsys, monkeypatch):
    """The trainer's own code path (ProgressCallback.on_log on rank 0) emits a parseable line."""
    training = pytest.importorskip("finetune_trainer.training")
    plan = training.RunPlan(start_step=4, start_samples=32, max_steps=20, global_batch=8, world_size=1,
                            resume_from=None, restore_optimizer=True)
    trainer = SimpleNamespace(tokens_seen=4096)
    callback = training.ProgressCallback(trainer, plan, attempt=3)
    callback.on_train_begin(None, None, None)
    state = SimpleNamespace(global_step=6, is_world_process_zero=True)
    callback.on_log(None, state, None, logs={"loss": 2.5, "learning_rate": 1e-4, "grad_norm": 0.5})
    parsed = last_progress(capsys.readouterr().out)
    assert parsed is not None
    assert (parsed.attempt, parsed.step, parsed.max_steps, parsed.start_step) == (3, 6, 20, 4)
    assert parsed.loss == 2.5 and parsed.tokens_per_second > 0 and parsed.samples_consumed == 48
    assert parsed.elapsed_seconds is not None and parsed.elapsed_seconds >= 0
    assert parsed.host_peak_rss_bytes or parsed.peak_allocated_bytes

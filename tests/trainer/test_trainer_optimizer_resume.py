"""A resume with another optimizer: the checkpoint records its optimizer, and state of
another optimizer is dropped on purpose (weights, step, LR schedule and data position
carry over) with a line that says so.

On CPU only AdamW runs (the 8-bit optimizers need bitsandbytes on CUDA: a ConfigError
here), so the checkpoint "of an 8-bit attempt" is a real AdamW checkpoint whose meta.json
names adamw-8bit, as a GPU attempt on the 8-bit rung writes it. What is checked is the
trainer's side: it reads the record and refuses the state, and the run shows it.
"""

from __future__ import annotations

import json
import shutil

import pytest

from .conftest import run_trainer, trainer_config, write_config

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def first_attempt(assets, tmp_path_factory):
    """6 full fine-tuning steps with AdamW, a checkpoint at step 4."""
    work = tmp_path_factory.mktemp("first")
    config = trainer_config(assets, work, maxSteps=6, checkpoint={"directory": str(work / "ckpt"), "everySteps": 4})
    run = run_trainer(write_config(work, config))
    assert run.returncode == 0, run.output[-3000:]
    meta = json.loads((work / "ckpt" / "step-00000004" / "meta.json").read_text())
    assert meta["optimizer"] == "adamw"
    return work, run


def _resume_from_edited(assets, tmp_path, first_attempt, edit):
    work, _ = first_attempt
    shutil.copytree(work / "ckpt", tmp_path / "ckpt")
    meta_path = tmp_path / "ckpt" / "step-00000004" / "meta.json"
    meta = json.loads(meta_path.read_text())
    edit(meta)
    meta_path.write_text(json.dumps(meta))
    config = trainer_config(assets, tmp_path, maxSteps=6, attempt=2,
                            checkpoint={"directory": str(tmp_path / "ckpt"), "everySteps": 4})
    run = run_trainer(write_config(tmp_path, config))
    assert run.returncode == 0, run.output[-3000:]
    return run


def test_state_of_another_optimizer_is_dropped_and_the_run_says_so(assets, tmp_path, first_attempt):
    _, first = first_attempt
    run = _resume_from_edited(assets, tmp_path, first_attempt, lambda meta: meta.update(optimizer="adamw-8bit"))
    [event] = run.of("resume")
    assert (event["step"], event["optimizerRestored"], event["fromOptimizer"]) == (4, False, "adamw-8bit")
    assert event["optimizerNotRestored"] == "the checkpoint holds adamw-8bit optimizer state and this attempt runs adamw"
    [warning] = [w for w in run.of("warning") if "without its optimizer state" in w["message"]]
    assert "adamw-8bit" in warning["message"] and "starts fresh" in warning["message"]
    losses = run.losses()
    assert sorted(losses) == [5, 6]
    # Step 5's loss is computed with the weights after step 4: they were loaded.
    assert losses[5] == pytest.approx(first.losses()[5], abs=2e-3)
    # Step 6 follows an update by a fresh AdamW (no moments): off the first attempt's curve
    # by more than the tolerance within which a full resume must continue it (the test
    # below); measured here: about 6e-3 apart.
    assert abs(losses[6] - first.losses()[6]) > 2e-3, (losses, first.losses())


def test_a_checkpoint_without_a_recorded_optimizer_resumes_as_adamw(assets, tmp_path, first_attempt):
    _, first = first_attempt
    run = _resume_from_edited(assets, tmp_path, first_attempt, lambda meta: meta.pop("optimizer"))
    [event] = run.of("resume")
    assert (event["optimizerRestored"], event["fromOptimizer"], event["optimizerNotRestored"]) == (True, "adamw", None)
    assert any("records no optimizer" in e["message"] and "taken as adamw" in e["message"] for e in run.of("info"))
    # Weights and AdamW state carry over: the curve continues exactly.
    for step, loss in run.losses().items():
        assert loss == pytest.approx(first.losses()[step], abs=2e-3), (step, run.losses(), first.losses())

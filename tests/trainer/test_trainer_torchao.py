"""torchao's low-bit AdamW (spec.training.optimizer torchao-adamw-8bit / -4bit) in the trainer, as
pods run it: it learns, a resume loads its quantised moments and continues the curve, and bf16
master weights round its updates stochastically.

torchao compiles each parameter shape's step (tens of seconds per shape on two cores); the runs
here set TORCHDYNAMO_DISABLE=1 so that the same step runs eagerly. What is checked (the moments
it keeps, their checkpoint, the learning) does not depend on compiling.
"""

from __future__ import annotations

import pytest

from .conftest import run_trainer, trainer_config, write_config

pytestmark = pytest.mark.slow
pytest.importorskip("torchao")

EAGER = {"TORCHDYNAMO_DISABLE": "1"}


@pytest.fixture(scope="module")
def eight_bit(assets, tmp_path_factory):
    """Full fine-tuning, torchao 8-bit AdamW, 6 steps, a checkpoint at step 4."""
    work = tmp_path_factory.mktemp("ao8")
    config = trainer_config(assets, work, maxSteps=6, optimizer="torchao-adamw-8bit",
                            checkpoint={"directory": str(work / "ckpt"), "everySteps": 4})
    run = run_trainer(write_config(work, config), extra_env=EAGER)
    assert run.returncode == 0, run.output[-3000:]
    return work, config, run


def test_eight_bit_learns_and_says_so(eight_bit):
    _, _, run = eight_bit
    [line] = run.of("levers")
    assert line["optimizer"] == "torchao-adamw-8bit"
    [built] = run.of("optimizer")
    assert built["implementation"] == "torchao.optim.adam.AdamW8bit", built
    losses = run.losses()
    assert sorted(losses) == [1, 2, 3, 4, 5, 6]
    assert losses[6] < losses[1] - 0.5, losses


def test_resume_loads_the_quantised_moments_and_continues_the_curve(eight_bit):
    import torch.distributed.checkpoint as dcp

    work, config, first = eight_bit
    metadata = dcp.FileSystemReader(str(work / "ckpt" / "step-00000004" / "dcp")).read_metadata()
    # The quantised moments are saved as torchao stores them: codes and block scales.
    assert any(key.endswith("exp_avg") for key in metadata.state_dict_metadata), list(metadata.state_dict_metadata)[:8]
    second = run_trainer(write_config(work, dict(config, attempt=2)), extra_env=EAGER)
    assert second.returncode == 0, second.output[-3000:]
    [event] = second.of("resume")
    assert (event["step"], event["optimizerRestored"], event["fromOptimizer"]) == (4, True, "torchao-adamw-8bit")
    for step, loss in second.losses().items():
        assert loss == pytest.approx(first.losses()[step], abs=2e-3), (step, second.losses(), first.losses())


def test_four_bit_with_bf16_master_weights_rounds_stochastically(assets, tmp_path):
    config = trainer_config(assets, tmp_path, maxSteps=4, optimizer="torchao-adamw-4bit", masterWeights="bf16",
                            updateRounding="stochastic", checkpoint=None)
    run = run_trainer(write_config(tmp_path, config), extra_env=EAGER)
    assert run.returncode == 0, run.output[-3000:]
    [line] = run.of("levers")
    assert (line["optimizer"], line["masterWeights"], line["updateRounding"]) == ("torchao-adamw-4bit", "bf16",
                                                                                  "stochastic")
    [built] = run.of("optimizer")
    assert built["implementation"] == "torchao.optim.adam.AdamW4bit", built
    losses = run.losses()
    assert losses[4] < losses[1], losses


def test_a_sharded_strategy_is_refused_with_the_field_named(assets, tmp_path):
    config = trainer_config(assets, tmp_path, maxSteps=2, optimizer="torchao-adamw-8bit", strategy="fsdp")
    run = run_trainer(write_config(tmp_path, config), extra_env=EAGER)
    assert run.returncode != 0
    assert "torchao's low-bit AdamW runs here with strategy ddp only" in run.output

"""Sequence parallelism (training.sequenceParallel) in the real trainer: DeepSpeed's Ulysses through
accelerate on two gloo ranks, against one process that runs the same micro-batches whole."""

from __future__ import annotations

import pytest

from finetune_trainer.contract import EXIT_CONFIG_ERROR, TrainerConfig, deepspeed_config

from .conftest import read_report, run_trainer, trainer_config, write_config

pytestmark = pytest.mark.slow

BASE = dict(method="lora", precision="fp32", learningRate=1e-2, strategy="zero2", deepspeed=deepspeed_config(2),
            microBatchSize=2, gradientAccumulation=2, lora={"rank": 8, "alpha": 16, "dropout": 0.0},
            evaluation={"heldOutFraction": 0.1, "everySteps": 2})


def test_a_sequence_split_over_two_ranks_trains_as_one_rank_and_resumes(assets, tmp_path):
    """Two ranks with sequenceParallel 2 are one data-parallel replica: each micro-batch is sliced over
    both, so every step trains on the examples one process trains on with the same micro-batch and
    accumulation, and in fp32 its loss, its evaluation and its token count are that process's. Both are
    killed after the checkpoint at step 4; the next attempt resumes there, the same way for both (the
    split's with the chunked loss). Every example of the test data has as many tokens, so the split's
    per-micro-batch mean and the whole run's mean over the step's tokens are the same loss here."""
    runs = {}
    for name, degree in (("whole", 1), ("split", 2)):
        work = tmp_path / name
        config = trainer_config(assets, work, **BASE, sequenceParallel=degree, maxSteps=6,
                                faultInjection={"kind": "kill", "step": 5, "attempt": 1})
        # The launcher (torchrun): DeepSpeed needs the process-group environment, one rank or two.
        first = run_trainer(write_config(work, config), nproc=degree, launcher=True)
        assert first.returncode != 0 and sorted(first.losses()) == [1, 2, 3, 4], first.output[-3000:]
        assert (work / "ckpt" / "step-00000004" / "deepspeed").is_dir()
        # The split's second attempt runs the chunked loss on each rank's slice (inside transformers' loss
        # of the split), as recovery may turn it on: the same losses.
        again = dict(config, attempt=2, **({"lossChunks": 4} if degree > 1 else {}))
        second = run_trainer(write_config(work, again), nproc=degree, launcher=True)
        assert second.returncode == 0, second.output[-3000:]
        [event] = second.of("resume")
        assert (event["step"], event["optimizerRestored"]) == (4, True)
        runs[name] = (first, second)
    (whole, whole_again), (split, split_again) = runs["whole"], runs["split"]
    assert split.of("start")[0]["globalBatch"] == 4  # micro 2 x accumulation 2 x one replica of two ranks
    assert split.of("levers")[0]["sequenceParallel"] == 2 and split_again.of("levers")[0]["lossChunks"] == 4
    for one, two in ((whole, split), (whole_again, split_again)):
        assert sorted(two.losses()) == sorted(one.losses())
        for step, loss in two.losses().items():
            assert loss == pytest.approx(one.losses()[step], abs=1e-4), (one.losses(), two.losses())
        evals = {e["step"]: e["evalLoss"] for e in one.of("eval")}
        assert sorted(evals) == sorted(e["step"] for e in two.of("eval"))
        for event in two.of("eval"):
            assert event["evalLoss"] == pytest.approx(evals[event["step"]], abs=1e-4)
    assert split_again.of("progress")[-1]["samplesConsumed"] == whole_again.of("progress")[-1]["samplesConsumed"]
    # The tokens of a sequence-parallel group's micro-batches are counted once.
    assert split_again.of("summary")[0]["tokens"] == whole_again.of("summary")[0]["tokens"]


def test_sequence_parallel_refusals_name_the_field(assets, tmp_path):
    """What the trainer cannot run split is a ConfigError naming sequenceParallel, before the model loads:
    a degree that does not divide the ranks or the accumulation (a step must run whole rounds of the
    group's micro-batches, or a resume would skip samples); and the config's own check refuses eager
    attention, and padding-free rows under sdpa (Ulysses drops the masks they need)."""
    config = trainer_config(assets, tmp_path, **BASE, sequenceParallel=2, maxSteps=2)
    run = run_trainer(write_config(tmp_path, config))  # one rank
    assert run.returncode == EXIT_CONFIG_ERROR, run.output[-2000:]
    assert "sequenceParallel 2 does not divide the 1 ranks" in read_report(tmp_path / "termination-log")["message"]

    from finetune_trainer.errors import ConfigError
    from finetune_trainer.model_setup import check_sequence_parallel

    odd = TrainerConfig.model_validate(dict(config, gradientAccumulation=3))
    with pytest.raises(ConfigError, match="sequenceParallel 2 must divide gradientAccumulation 3"):
        check_sequence_parallel(odd, 2)
    check_sequence_parallel(TrainerConfig.model_validate(config), 2)

    for attention, dataset in (("eager", {}), ("sdpa", {"paddingFree": True})):
        config = trainer_config(assets, tmp_path, **BASE, sequenceParallel=2, maxSteps=2, attention=attention,
                                dataset={"path": str(assets["chat"]), "format": "chat", **dataset})
        with pytest.raises(ValueError, match="sequenceParallel: sequence parallelism .*needs"):
            TrainerConfig.model_validate(config)

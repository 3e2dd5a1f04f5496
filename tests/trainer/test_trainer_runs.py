"""The trainer end to end on CPU: a tiny Llama, real transformers/peft/torch.distributed/DeepSpeed.

Single-process runs stand in for one GPU, ``torchrun --nproc-per-node 2`` with gloo for
two. Every run is a fresh process, as in a pod.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from finetune_trainer.contract import EXIT_CONFIG_ERROR, EXIT_DATA_ERROR, EXIT_GPU_OOM, deepspeed_config

from .conftest import read_report, run_trainer, trainer_config, write_config

pytestmark = pytest.mark.slow


def assert_loss_goes_down(losses: dict[int, float], by: float) -> None:
    steps = sorted(losses)
    first, last = losses[steps[0]], losses[steps[-1]]
    assert last < first - by, f"loss did not go down by {by}: {losses}"


@pytest.fixture(scope="module")
def reference(assets, tmp_path_factory):
    """An uninterrupted full fine-tuning run, 10 steps, checkpoint every 2, keep 2."""
    work = tmp_path_factory.mktemp("reference")
    config = trainer_config(assets, work, checkpoint={"directory": str(work / "ckpt"), "everySteps": 2, "keepLast": 2})
    run = run_trainer(write_config(work, config))
    assert run.returncode == 0, run.output[-3000:]
    return work, run


def test_full_finetuning_loss_goes_down_and_keeps_last_checkpoints(reference):
    work, run = reference
    losses = run.losses()
    assert sorted(losses) == list(range(1, 11))
    assert_loss_goes_down(losses, by=0.8)
    # Saved at 2, 4, 6, 8 (not at the last step, which writes the output); last 2 kept.
    assert sorted(p.name for p in (work / "ckpt").iterdir()) == ["step-00000006", "step-00000008"]
    progress = run.of("progress")[-1]
    for key in ("learningRate", "gradNorm", "tokensPerSecond", "samplesConsumed", "hostPeakRssBytes"):
        assert key in progress
    assert progress["samplesConsumed"] == 80
    [summary] = run.of("summary")
    assert summary["status"] == "completed" and summary["step"] == 10 and summary["tokens"] > 0
    assert (work / "out" / "model.safetensors").is_file() and (work / "out" / "tokenizer.json").is_file()
    # Full fine-tuning exports its weights by default: <output>/full, in the training dtype (bf16).
    [export] = run.of("export", rank=None)
    assert export["kind"] == "full" and export["directory"] == str(work / "out" / "full")
    config = json.loads((work / "out" / "full" / "config.json").read_text())
    assert config["torch_dtype"] == "bfloat16" and (work / "out" / "full" / "model.safetensors.index.json").is_file()


def test_a_finished_run_records_what_it_trained_on_beside_its_output(reference, assets):
    """provenance/attempt-1.json in the output and the digests in the success report agree with the
    dataset file and the run's own summary line."""
    work, run = reference
    [summary] = run.of("summary")
    record = json.loads((work / "out" / "provenance" / "attempt-1.json").read_text())
    data = assets["chat"]
    [entry] = record["datasetFiles"]
    assert entry == {"name": data.name, "sha256": hashlib.sha256(data.read_bytes()).hexdigest(),
                     "bytes": data.stat().st_size}
    lines = [line for line in data.read_text().splitlines() if line.strip()]
    facts = record["summary"]
    assert facts["records"] == len(lines) and facts["tokens"] == summary["tokens"] > 0
    assert facts["baseConfigSha256"] == hashlib.sha256((assets["model"] / "config.json").read_bytes()).hexdigest()
    assert record["steps"] == 10 and record["attempt"] == 1
    report = read_report(work / "termination-log")
    assert report["outcome"] == "Succeeded" and report["facts"] == facts


def test_lora_loss_goes_down_and_resumes_adapters_with_another_micro_batch(assets, tmp_path):
    config = trainer_config(
        assets, tmp_path, method="lora", learningRate=1e-2, maxSteps=6,
        lora={"rank": 8, "alpha": 16, "dropout": 0.0, "targetModules": "all-linear"},
        dataset={"path": str(assets["instruction"]), "format": "instruction"},
    )
    first = run_trainer(write_config(tmp_path, config))
    assert first.returncode == 0, first.output[-3000:]
    assert_loss_goes_down(first.losses(), by=0.3)
    out = tmp_path / "out"
    assert (out / "adapter_config.json").is_file() and (out / "adapter_model.safetensors").is_file()
    assert json.loads((out / "adapter_config.json").read_text())["r"] == 8

    # Next attempt: one micro-batch of 8 instead of 4 x 2; adapters and their AdamW state carry over.
    config.update(maxSteps=10, microBatchSize=8, gradientAccumulation=1, attempt=2)
    second = run_trainer(write_config(tmp_path, config))
    assert second.returncode == 0, second.output[-3000:]
    [event] = second.of("resume")
    assert (event["step"], event["optimizerRestored"], event["fromMicroBatchSize"]) == (4, True, 4)
    assert sorted(second.losses()) == [5, 6, 7, 8, 9, 10]
    # Same global batch and data: step 5 matches the first attempt's step 5.
    assert second.losses()[5] == pytest.approx(first.losses()[5], abs=0.02)
    assert second.losses()[10] < first.losses()[1] - 0.3


def test_a_packed_lora_run_trains_on_whole_examples_and_resumes_the_same_sequences(assets, tmp_path):
    """spec.dataset.packing in the real trainer: the loss goes down, the trained tokens are the
    examples' real tokens (no padding counted), and a resumed attempt with another micro-batch
    packs the same sequences (its step matches the first attempt's)."""
    config = trainer_config(assets, tmp_path, method="lora", learningRate=1e-2, maxSteps=6,
                            lora={"rank": 8, "alpha": 16, "dropout": 0.0, "targetModules": "all-linear"},
                            dataset={"path": str(assets["chat"]), "format": "chat", "packing": True})
    first = run_trainer(write_config(tmp_path, config))
    assert first.returncode == 0, first.output[-3000:]
    assert_loss_goes_down(first.losses(), by=0.2)
    [start] = first.of("start")
    [summary] = first.of("summary")
    # 6 steps of 8 packed sequences of at most 64 tokens, without the pad runs.
    assert 0 < summary["tokens"] <= 6 * 8 * 64
    config.update(maxSteps=8, microBatchSize=8, gradientAccumulation=1, attempt=2)
    second = run_trainer(write_config(tmp_path, config))
    assert second.returncode == 0, second.output[-3000:]
    assert second.of("start")[0]["examples"] == start["examples"]
    assert second.losses()[5] == pytest.approx(first.losses()[5], abs=0.02)


def test_padding_free_trains_on_the_same_examples_as_padding_and_checks_the_declared_lengths(assets, tmp_path):
    """spec.dataset.paddingFree in the real trainer: each micro-batch's examples end to end in one row
    (sdpa: a block-diagonal mask from the restarting positions). A step sees the same examples as with
    padding, so in fp32 the loss of every step is the padded run's. Then spec.dataset.microBatchTokens
    declared below what the run's stream holds: the attempt fails with a DataError naming the field and
    the right values, before the model loads."""
    base = dict(method="lora", precision="fp32", learningRate=1e-2, maxSteps=3, checkpoint=None,
                lora={"rank": 8, "alpha": 16, "dropout": 0.0, "targetModules": "all-linear"})
    runs = {}
    for name, extra in (("padded", {}), ("paddingFree", {"paddingFree": True})):
        work = tmp_path / name
        work.mkdir()
        # text: every token is a target, so a boundary that leaked a target would show in the loss.
        config = trainer_config(assets, work, **base, dataset={"path": str(assets["text"]), "format": "text", **extra})
        runs[name] = run_trainer(write_config(work, config))
        assert runs[name].returncode == 0, runs[name].output[-3000:]
    padded, free = runs["padded"].losses(), runs["paddingFree"].losses()
    assert sorted(free) == [1, 2, 3]
    for step in free:
        assert free[step] == pytest.approx(padded[step], abs=1e-3), (padded, free)
    # The same real tokens counted either way (the padded batches' padding is not counted).
    assert runs["paddingFree"].of("summary")[0]["tokens"] == runs["padded"].of("summary")[0]["tokens"]
    # The start line prints what micro-batches of this run's data hold, for the job to declare.
    measured = runs["paddingFree"].of("start")[0]["microBatchTokens"]
    assert len(measured) == 64 and measured == sorted(measured) and measured[0] <= 64  # sequenceLength

    work = tmp_path / "declared"
    work.mkdir()
    config = trainer_config(assets, work, **base, dataset={"path": str(assets["chat"]), "format": "chat",
                                                           "paddingFree": True, "microBatchTokens": [8, 12]})
    failed = run_trainer(write_config(work, config))
    assert failed.returncode == EXIT_DATA_ERROR, failed.output[-2000:]
    report = read_report(work / "termination-log")
    assert report["reason"] == "DataError" and report["phase"] == "data"
    assert "spec.dataset.microBatchTokens: 1 consecutive examples" in report["message"], report["message"]
    assert "more than the 8 declared; the data holds [" in report["message"]


def test_a_lora_run_on_two_ranks_exports_a_merged_folder_that_computes_base_plus_adapter(assets, tmp_path):
    """export merged: rank 0 alone merges after training (after the ranks' teardown); the folder loads
    with transformers and gives the logits of the base with the adapter the run saved (fp32 training,
    so the comparison is tight); the success report says where it went."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    config = trainer_config(assets, tmp_path, method="lora", precision="fp32", learningRate=1e-2, maxSteps=3,
                            checkpoint=None, export="merged",
                            lora={"rank": 8, "alpha": 16, "dropout": 0.0, "targetModules": "all-linear"})
    run = run_trainer(write_config(tmp_path, config), nproc=2)
    assert run.returncode == 0, run.output[-3000:]
    out = tmp_path / "out"
    [export] = run.of("export", rank=None)
    assert export["rank"] == 0 and export["kind"] == "merged" and export["directory"] == str(out / "merged")
    assert export["peakRssBytes"] > 0 and export["shards"] == 1
    report = read_report(tmp_path / "termination-log")
    assert report["export"]["directory"] == str(out / "merged") and report["export"]["kind"] == "merged"
    assert (out / "adapter_model.safetensors").is_file()  # the adapter stays beside it
    tokens = torch.tensor([[2, 8, 9, 10, 11, 12, 3]])
    with torch.no_grad():
        merged = AutoModelForCausalLM.from_pretrained(out / "merged", dtype=torch.float32).eval()(tokens).logits
        base = AutoModelForCausalLM.from_pretrained(assets["model"], dtype=torch.float32)
        adapted = PeftModel.from_pretrained(base, out).eval()(tokens).logits
    assert (merged - adapted).abs().max().item() <= 5e-7 * max(1.0, adapted.abs().max().item())


def test_the_same_lora_config_gives_the_same_losses(assets, tmp_path):
    """A run is a function of its config: the adapters' random start is seeded too (it is
    drawn when the model is built, before the Trainer seeds). Unseeded, step 2 differed by
    about 0.3% between two runs."""
    losses = []
    for run_dir in (tmp_path / "a", tmp_path / "b"):
        run_dir.mkdir()
        config = trainer_config(assets, run_dir, method="lora", maxSteps=3, checkpoint=None,
                                lora={"rank": 8, "alpha": 16, "dropout": 0.05, "targetModules": "all-linear"})
        run = run_trainer(write_config(run_dir, config))
        assert run.returncode == 0, run.output[-3000:]
        losses.append(run.losses())
    assert sorted(losses[0]) == [1, 2, 3]
    assert losses[1] == pytest.approx(losses[0], rel=1e-5)


def test_killed_after_a_checkpoint_resumes_where_it_stopped(assets, tmp_path, reference):
    _, reference_run = reference
    config = trainer_config(assets, tmp_path, faultInjection={"kind": "kill", "step": 6, "phase": "forward"})
    killed = run_trainer(write_config(tmp_path, config))
    assert killed.returncode == -9
    assert sorted(killed.losses()) == [1, 2, 3, 4, 5]
    assert [p.name for p in (tmp_path / "ckpt").iterdir()] == ["step-00000004"]

    config.pop("faultInjection")
    config["attempt"] = 2
    resumed = run_trainer(write_config(tmp_path, config))
    assert resumed.returncode == 0, resumed.output[-3000:]
    [event] = resumed.of("resume")
    assert event["step"] == 4 and event["optimizerRestored"] is True and event["samplesConsumed"] == 32
    losses = resumed.losses()
    assert sorted(losses) == [5, 6, 7, 8, 9, 10]
    # Same data, same weights and optimizer state: the curve continues exactly.
    for step, loss in losses.items():
        assert loss == pytest.approx(reference_run.losses()[step], abs=2e-3), (step, losses)


def test_recovery_to_bf16_master_weights_and_the_step_in_backward_resumes_the_fp32_state(assets, tmp_path, reference):
    """A recovery rung that switches masterWeights to bf16 (Kahan) and the optimizer step
    in backward: the fp32 checkpoint's weights and AdamW moments load (cast to bf16, into
    one optimizer per parameter instead of one for all), the Kahan buffers it lacks start
    at zero, the LR schedule is regrouped, and the curve continues."""
    import shutil

    work, reference_run = reference
    shutil.copytree(work / "ckpt", tmp_path / "ckpt")
    config = trainer_config(assets, tmp_path, masterWeights="bf16", updateRounding="kahan", optimizerInBackward=True,
                            maxGradNorm=0, microBatchSize=8, gradientAccumulation=1, attempt=2)
    run = run_trainer(write_config(tmp_path, config))
    assert run.returncode == 0, run.output[-3000:]
    [event] = run.of("resume")
    assert (event["step"], event["optimizerRestored"], event["fromMasterWeights"]) == (8, True, "fp32")
    assert any("no optimizer state kahan_comp" in e["message"] for e in run.of("info"))
    assert sorted(run.losses()) == [9, 10]
    # bf16 weights instead of fp32 (and no clipping): measured 2e-3 apart.
    for step in (9, 10):
        assert run.losses()[step] == pytest.approx(reference_run.losses()[step], abs=0.02), run.losses()
    assert run.of("progress")[-1]["learningRate"] == pytest.approx(reference_run.of("progress")[-1]["learningRate"])


def test_torchrun_ddp_then_fsdp_then_one_process_with_other_micro_batches(assets, tmp_path, reference):
    """Two ranks under DDP, resumed on two ranks under FSDP with another micro-batch,
    resumed again on one process: step, samples and loss carry over each time."""
    _, reference_run = reference
    ddp = trainer_config(assets, tmp_path, strategy="ddp", microBatchSize=2, gradientAccumulation=2, maxSteps=6)
    first = run_trainer(write_config(tmp_path, ddp), nproc=2)
    assert first.returncode == 0, first.output[-3000:]
    assert first.of("start")[0]["worldSize"] == 2 and first.of("start")[0]["globalBatch"] == 8
    assert_loss_goes_down(first.losses(), by=0.5)
    # Two ranks see the same global batch of 8 as the single-process reference.
    assert first.losses()[4] == pytest.approx(reference_run.losses()[4], abs=0.05)

    fsdp = dict(ddp, strategy="fsdp", microBatchSize=1, gradientAccumulation=4, maxSteps=10, attempt=2)
    second = run_trainer(write_config(tmp_path, fsdp), nproc=2)
    assert second.returncode == 0, second.output[-3000:]
    [event] = second.of("resume")
    assert (event["step"], event["fromStrategy"], event["optimizerRestored"]) == (4, "ddp", True)
    assert sorted(second.losses()) == [5, 6, 7, 8, 9, 10]
    assert second.losses()[5] == pytest.approx(reference_run.losses()[5], abs=0.05)
    # FSDP gathers the shards: the output is the whole model, in fp32.
    from safetensors import safe_open

    with safe_open(tmp_path / "out" / "model.safetensors", "pt") as out, \
            safe_open(assets["model"] / "model.safetensors", "pt") as base:
        assert sorted(out.keys()) == sorted(base.keys())
        for key in base.keys():
            assert out.get_slice(key).get_shape() == base.get_slice(key).get_shape()
            assert out.get_slice(key).get_dtype() == "F32"

    single = dict(fsdp, strategy="ddp", microBatchSize=8, gradientAccumulation=1, maxSteps=12, attempt=3)
    third = run_trainer(write_config(tmp_path, single))
    assert third.returncode == 0, third.output[-3000:]
    [event] = third.of("resume")
    assert (event["step"], event["fromStrategy"], event["fromWorldSize"]) == (8, "fsdp", 2)
    assert event["optimizerRestored"] is True
    assert sorted(third.losses()) == [9, 10, 11, 12]
    # Continues from the FSDP run's state at step 8, not from the base model.
    assert third.losses()[9] == pytest.approx(second.losses()[9], abs=0.05)
    assert third.of("progress")[-1]["samplesConsumed"] == 96


def test_deepspeed_zero2_lora_then_zero3_resume(assets, tmp_path):
    lora = {"rank": 8, "alpha": 16, "dropout": 0.0}
    zero2 = trainer_config(assets, tmp_path, method="lora", lora=lora, learningRate=1e-2, strategy="zero2",
                           deepspeed=deepspeed_config(2), microBatchSize=2, gradientAccumulation=2, maxSteps=6)
    first = run_trainer(write_config(tmp_path, zero2), nproc=2)
    assert first.returncode == 0, first.output[-3000:]
    assert_loss_goes_down(first.losses(), by=0.2)
    assert (tmp_path / "ckpt" / "step-00000004" / "deepspeed").is_dir()

    # Another ZeRO stage: DeepSpeed's own checkpoint cannot carry the optimizer
    # there; the weights (via zero_to_fp32) and the step do, and the run says so.
    zero3 = dict(zero2, strategy="zero3", deepspeed=deepspeed_config(3), maxSteps=9, attempt=2)
    second = run_trainer(write_config(tmp_path, zero3), nproc=2)
    assert second.returncode == 0, second.output[-3000:]
    [event] = second.of("resume")
    assert (event["step"], event["fromStrategy"], event["optimizerRestored"]) == (4, "zero2", False)
    assert second.losses()[5] == pytest.approx(first.losses()[5], abs=0.02)
    assert (tmp_path / "out" / "adapter_model.safetensors").is_file()

    # Same stage and world size: DeepSpeed's checkpoint restores the optimizer too.
    again = dict(zero3, maxSteps=10, attempt=3)
    third = run_trainer(write_config(tmp_path, again), nproc=2)
    assert third.returncode == 0, third.output[-3000:]
    [event] = third.of("resume")
    assert (event["step"], event["fromStrategy"], event["optimizerRestored"]) == (8, "zero3", True)
    assert third.losses()[9] == pytest.approx(second.losses()[9], abs=2e-3)


def test_injected_gpu_oom_on_one_rank_gives_the_report_and_exit_code(assets, tmp_path):
    """Rank 1 runs out of memory in backward at step 3 (the hook raises inside autograd)."""
    config = trainer_config(assets, tmp_path, microBatchSize=2, gradientAccumulation=2, checkpoint=None,
                            faultInjection={"kind": "gpu-oom", "step": 3, "phase": "backward", "rank": 1})
    run = run_trainer(write_config(tmp_path, config), nproc=2, launcher=True)
    # The trainer process exits 75; torchrun itself would exit 1, the launcher passes
    # the report's code on as the pod's.
    assert run.returncode == EXIT_GPU_OOM, run.output[-3000:]
    assert f"exitcode  : {EXIT_GPU_OOM}" in run.output
    report = read_report(tmp_path / "termination-log")
    assert (report["reason"], report["phase"], report["step"], report["rank"]) == ("GPUOutOfMemory", "backward", 3, 1)
    assert (report["microBatchSize"], report["sequenceLength"], report["exitCode"]) == (2, 64, EXIT_GPU_OOM)
    assert report["worldSize"] == 2 and report["attempt"] == 1
    assert sorted(run.losses()) == [1, 2]
    assert run.of("failure", rank=1)[0]["reason"] == "GPUOutOfMemory"
    # The other rank either fails on the broken collective first (and logs a failure of
    # unknown cause) or is stopped by torchrun first (and logs none): a race between the
    # peer's closed socket and torchrun's SIGTERM. Either way the report keeps rank 1's cause.
    assert [event["reason"] for event in run.of("failure", rank=0)] in ([], ["Unknown"])


@pytest.fixture
def offline(monkeypatch):
    """In-process runs set these; keep them from leaking into other tests."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


def test_malformed_dataset_line_is_a_data_error(assets, tmp_path, offline):
    from finetune_trainer.run import main

    lines = assets["chat"].read_text().splitlines()
    lines[6] = lines[6][:-5]
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join(lines) + "\n")
    config = trainer_config(assets, tmp_path, dataset={"path": str(bad), "format": "chat"})
    assert main(["--config", str(write_config(tmp_path, config))]) == EXIT_DATA_ERROR
    report = read_report(tmp_path / "termination-log")
    assert report["reason"] == "DataError" and report["phase"] == "data"
    assert f"line 7 of {bad}" in report["message"]


def test_qlora_without_cuda_is_a_config_error(assets, tmp_path, offline):
    from finetune_trainer.run import main

    config = trainer_config(assets, tmp_path, method="qlora")
    assert main(["--config", str(write_config(tmp_path, config))]) == EXIT_CONFIG_ERROR
    report = read_report(tmp_path / "termination-log")
    assert report["reason"] == "ConfigError" and "qlora needs CUDA" in report["message"]


def test_invalid_config_is_a_config_error_naming_the_field(tmp_path, offline):
    from finetune_trainer.run import main

    path = write_config(tmp_path, {"jobName": "x", "microBatchSize": 0})
    assert main(["--config", str(path), "--report-path", str(tmp_path / "log")]) == EXIT_CONFIG_ERROR
    report = read_report(tmp_path / "log")
    assert report["reason"] == "ConfigError" and "microBatchSize" in report["message"]


def test_held_out_evaluation_every_n_steps_and_at_the_end_and_the_same_split_after_a_resume(assets, tmp_path):
    """spec.evaluation: eval lines at the cadence and at the last step, the eval loss carried on the
    progress lines, the held-out sequences never trained on, the same split on a resumed attempt."""
    config = trainer_config(assets, tmp_path, method="lora", learningRate=1e-2, maxSteps=7,
                            lora={"rank": 8, "alpha": 16, "dropout": 0.0, "targetModules": "all-linear"},
                            evaluation={"heldOutFraction": 0.25, "everySteps": 3},
                            checkpoint={"directory": str(tmp_path / "ckpt"), "everySteps": 2, "keepLast": 2})
    run = run_trainer(write_config(tmp_path, config))
    assert run.returncode == 0, run.output[-3000:]
    evals = run.of("eval")
    assert [e["step"] for e in evals] == [3, 6, 7], evals
    assert all(e["evalLoss"] > 0 and e["evalPerplexity"] > 1 for e in evals)
    progress = {e["step"]: e for e in run.of("progress")}
    assert "evalLoss" not in progress[2] and progress[4]["evalLoss"] == evals[0]["evalLoss"]
    assert progress[4]["evalStep"] == 3
    # An evaluation is repeated on a progress line at once (the operator reads only those), so the
    # final one, after the last logging step, reaches status.progress too.
    last = run.of("progress")[-1]
    assert (last["step"], last["evalStep"], last["evalLoss"]) == (7, 7, evals[-1]["evalLoss"]), last
    [start] = run.of("start")
    lines = [line for line in assets["chat"].read_text().splitlines() if line.strip()]
    assert start["heldOut"] == round(len(lines) * 0.25) and start["examples"] == len(lines) - start["heldOut"]
    [summary] = run.of("summary")
    assert summary["evalLoss"] == evals[-1]["evalLoss"] and summary["evalStep"] == 7
    facts = read_report(tmp_path / "termination-log")["facts"]  # what status.provenance gets
    assert (facts["heldOut"], facts["evalLoss"]) == (start["heldOut"], evals[-1]["evalLoss"]), facts
    # Evaluation tokens are not training tokens: the count is the training batches' alone.
    resumed = dict(config, maxSteps=9, attempt=2)
    again = run_trainer(write_config(tmp_path, resumed, "config2.json"))
    assert again.returncode == 0, again.output[-3000:]
    [restart] = again.of("start")
    assert restart["startStep"] == 6 and restart["heldOutSha256"] == start["heldOutSha256"], (restart, start)
    # Another run of the same config evaluates the same samples from the same weights: the same losses.
    redo = run_trainer(write_config(tmp_path / "redo", dict(config, checkpoint=None)))
    assert redo.returncode == 0, redo.output[-3000:]
    assert [round(e["evalLoss"], 3) for e in redo.of("eval")] == [round(e["evalLoss"], 3) for e in evals]


def test_a_separate_eval_dataset_is_evaluated_whole_and_training_keeps_all_of_its_data(assets, tmp_path):
    """spec.evaluation.dataset: every sequence of the eval file is evaluated on, none of the training
    data is held out, the eval file's digest reaches the provenance facts and the attempt record; an
    eval file that does not exist fails the run with a DataError naming the field."""
    eval_file = tmp_path / "eval.jsonl"
    lines = [line for line in assets["chat"].read_text().splitlines() if line.strip()]
    eval_file.write_text("\n".join(lines[:6]) + "\n")
    config = trainer_config(assets, tmp_path, method="lora", maxSteps=4,
                            lora={"rank": 8, "alpha": 16, "dropout": 0.0, "targetModules": "all-linear"},
                            evaluation={"dataset": {"path": str(eval_file), "format": "chat"}, "everySteps": 2})
    run = run_trainer(write_config(tmp_path, config))
    assert run.returncode == 0, run.output[-3000:]
    assert [e["step"] for e in run.of("eval")] == [2, 4]
    [start] = run.of("start")
    assert start["examples"] == len(lines) and start["heldOut"] == 0 and start["evalSequences"] == 6, start
    facts = read_report(tmp_path / "termination-log")["facts"]
    assert facts["evalExamples"] == 6 and len(facts["evalDatasetSha256"]) == 64 and facts.get("heldOut", 0) == 0
    record = json.loads((Path(config["outputDirectory"]) / "provenance" / "attempt-1.json").read_text())
    assert [f["name"] for f in record["evalDatasetFiles"]] == ["eval.jsonl"]
    missing = dict(config, evaluation={"dataset": {"path": str(tmp_path / "nope.jsonl"), "format": "chat"}},
                   reportPath=str(tmp_path / "missing-log"))
    failed = run_trainer(write_config(tmp_path, missing, "missing.json"))
    report = read_report(tmp_path / "missing-log")
    assert failed.returncode != 0 and report["reason"] == "DataError", failed.output[-2000:]
    assert "spec.evaluation.dataset" in report["message"]


def test_early_stopping_counts_across_a_resumed_attempt(assets, tmp_path):
    """earlyStopping: with a learning rate of 1e-9 the eval loss never improves on the first
    evaluation by more than minDelta, so patience 2 stops after the third; an attempt that fails after the second and
    resumes from its checkpoint carries the count (a fresh count would run two evaluations more)."""
    config = trainer_config(assets, tmp_path, method="lora", learningRate=1e-9, maxSteps=20,
                            lora={"rank": 8, "alpha": 16, "dropout": 0.0, "targetModules": "all-linear"},
                            evaluation={"heldOutFraction": 0.25, "everySteps": 2,
                                        "earlyStopping": {"patience": 2, "minDelta": 0.001}},
                            checkpoint={"directory": str(tmp_path / "ckpt"), "everySteps": 4, "keepLast": 2},
                            faultInjection={"kind": "error", "step": 5, "phase": "forward", "attempt": 1})
    first = run_trainer(write_config(tmp_path, config))
    assert first.returncode != 0 and [e["step"] for e in first.of("eval")] == [2, 4], first.output[-2000:]
    resumed = dict(config, attempt=2, reportPath=str(tmp_path / "log2"))  # a new pod's termination log
    again = run_trainer(write_config(tmp_path, resumed, "config2.json"))
    assert again.returncode == 0, again.output[-3000:]
    assert [e["step"] for e in again.of("eval")] == [6]
    [stop] = again.of("early-stop")
    assert (stop["step"], stop["bestStep"]) == (6, 2), stop
    [summary] = again.of("summary")
    assert summary["step"] == 6
    facts = read_report(tmp_path / "log2")["facts"]
    assert (facts["stoppedEarlyAt"], facts["bestEvalStep"]) == (6, 2), facts


def test_keep_best_makes_the_output_the_best_evaluations_model(assets, tmp_path):
    """keepBest: an improvement counts only beyond minDelta, so with minDelta 1.0 the first
    evaluation stays the best while training goes on to step 8; the output is then the adapter
    saved at that evaluation (in <checkpoints>/best), not the last step's."""
    config = trainer_config(assets, tmp_path, method="lora", learningRate=1e-2, maxSteps=8,
                            lora={"rank": 8, "alpha": 16, "dropout": 0.0, "targetModules": "all-linear"},
                            evaluation={"heldOutFraction": 0.25, "everySteps": 2, "keepBest": True,
                                        "earlyStopping": {"patience": 10, "minDelta": 1.0}},
                            checkpoint={"directory": str(tmp_path / "ckpt"), "everySteps": 4, "keepLast": 2})
    run = run_trainer(write_config(tmp_path, config))
    assert run.returncode == 0, run.output[-3000:]
    evals = {e["step"]: e["evalLoss"] for e in run.of("eval")}
    assert sorted(evals) == [2, 4, 6, 8] and evals[8] < evals[2], evals  # it learned, by less than 1.0
    [saved] = run.of("best-model")
    assert saved["step"] == 2
    facts = read_report(tmp_path / "termination-log")["facts"]
    assert (facts["bestEvalStep"], facts["outputIsBest"]) == (2, True), facts
    output, best = Path(config["outputDirectory"]), tmp_path / "ckpt" / "best"
    assert json.loads((best / "best-eval.json").read_text())["step"] == 2
    assert (output / "adapter_model.safetensors").read_bytes() == (best / "adapter_model.safetensors").read_bytes()
    # The same run without keepBest ends with another adapter: the last step's.
    last = dict(config, evaluation=dict(config["evaluation"], keepBest=False),
                outputDirectory=str(tmp_path / "last"), checkpoint=None, reportPath=str(tmp_path / "last-log"))
    plain = run_trainer(write_config(tmp_path, last, "last.json"))
    assert plain.returncode == 0, plain.output[-3000:]
    assert [round(e["evalLoss"], 4) for e in plain.of("eval")] == [round(evals[s], 4) for s in (2, 4, 6, 8)]
    assert (output / "adapter_model.safetensors").read_bytes() != (tmp_path / "last" / "adapter_model.safetensors").read_bytes()

"""The trainer contract: config in, failure report out (pydantic only)."""

import json
import subprocess
import sys

import pytest
from pydantic import ValidationError

from finetune_trainer.contract import (
    EXIT_CONFIG_ERROR,
    EXIT_DATA_ERROR,
    EXIT_GPU_OOM,
    EXIT_HOST_OOM,
    EXIT_SIGKILL,
    EXIT_SIGTERM,
    EXIT_UNKNOWN,
    TERMINATION_MESSAGE_LIMIT,
    ConfigLoadError,
    FailureReason,
    FailureReport,
    Phase,
    TrainerConfig,
    deepspeed_config,
    load_trainer_config,
    parse_failure_report,
    reason_for_exit_code,
)


def minimal(**over):
    doc = {
        "jobName": "support-bot",
        "model": {"path": "/models/llama"},
        "dataset": {"path": "/data/train.jsonl", "format": "chat"},
        "maxSteps": 10,
        "outputDirectory": "/out",
    }
    doc.update(over)
    return doc


def test_camel_case_round_trip():
    cfg = TrainerConfig.model_validate(
        minimal(
            microBatchSize=4,
            gradientAccumulation=8,
            lora={"rank": 8, "targetModules": ["q_proj", "v_proj"]},
            checkpoint={"directory": "/ckpt", "everySteps": 50, "keepLast": 3},
            faultInjection={"kind": "gpu-oom", "step": 3, "phase": "backward"},
        )
    )
    assert cfg.micro_batch_size == 4 and cfg.gradient_accumulation == 8
    assert cfg.lora.target_modules == ["q_proj", "v_proj"]
    assert cfg.checkpoint.keep_last == 3
    data = json.loads(cfg.to_json())
    assert data["microBatchSize"] == 4
    assert data["checkpoint"]["everySteps"] == 50
    assert data["faultInjection"]["phase"] == "backward"
    assert data["reportPath"] == "/dev/termination-log"
    assert TrainerConfig.model_validate_json(cfg.to_json()) == cfg


def test_unknown_field_is_rejected_by_name():
    with pytest.raises(ValidationError, match="microBatch"):
        TrainerConfig.model_validate(minimal(microBatch=2))


@pytest.mark.parametrize(
    "over, needle",
    [
        ({"epochs": 1}, "exactly one of maxSteps and epochs"),
        ({"strategy": "zero3"}, "needs a deepspeed config"),
        ({"strategy": "zero2", "deepspeed": deepspeed_config(3)}, "stage is 3"),
        ({"strategy": "ddp", "offload": "optimizer"}, "offload needs"),
        ({"strategy": "zero2", "offload": "optimizer", "deepspeed": deepspeed_config(2)}, "does not match"),
        ({"strategy": "ddp", "fsdp": {}}, "fsdp settings given"),
        ({"method": "qlora", "strategy": "zero2", "deepspeed": deepspeed_config(2)}, "zero1 and zero2 are not run"),
        ({"optimizerInBackward": True, "gradientAccumulation": 2, "maxGradNorm": 0}, "gradient accumulation 1"),
        ({"optimizerInBackward": True}, "cannot clip by global norm"),
        ({"masterWeights": "bf16", "method": "lora"}, "LoRA adapters always train in fp32"),
        ({"activationOffloading": True}, "needs gradient checkpointing"),
        ({"lora": {"targetModules": []}}, "targetModules"),
        ({"precision": "int8"}, "precision"),
    ],
)
def test_inconsistent_configs_are_rejected(over, needle):
    with pytest.raises(ValidationError, match=needle):
        TrainerConfig.model_validate(minimal(**over))


def test_deepspeed_config_matches_strategy_and_offload():
    cfg = TrainerConfig.model_validate(
        minimal(strategy="zero3", offload="optimizer+params", deepspeed=deepspeed_config(3, "optimizer+params"))
    )
    assert cfg.zero_stage == 3
    assert cfg.deepspeed["zero_optimization"]["offload_param"]["device"] == "cpu"
    with pytest.raises(ValueError):
        deepspeed_config(2, "optimizer+params")


def test_load_trainer_config_names_the_field(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(minimal(microBatchSize=0)))
    with pytest.raises(ConfigLoadError, match="microBatchSize"):
        load_trainer_config(path)
    with pytest.raises(ConfigLoadError, match="cannot read"):
        load_trainer_config(tmp_path / "missing.json")


def test_exit_codes_map_to_reasons():
    assert reason_for_exit_code(0) is None
    assert reason_for_exit_code(EXIT_GPU_OOM) is FailureReason.GPU_OUT_OF_MEMORY
    assert reason_for_exit_code(EXIT_HOST_OOM) is FailureReason.HOST_OUT_OF_MEMORY
    assert reason_for_exit_code(EXIT_DATA_ERROR) is FailureReason.DATA_ERROR
    assert reason_for_exit_code(EXIT_CONFIG_ERROR) is FailureReason.CONFIG_ERROR
    assert reason_for_exit_code(EXIT_UNKNOWN) is FailureReason.UNKNOWN
    codes = {EXIT_GPU_OOM, EXIT_HOST_OOM, EXIT_DATA_ERROR, EXIT_CONFIG_ERROR, EXIT_UNKNOWN}
    assert len(codes) == 5 and not codes & {EXIT_SIGKILL, EXIT_SIGTERM}
    # A signal death is not our report: the operator must read the container reason.
    assert reason_for_exit_code(EXIT_SIGKILL) is FailureReason.UNKNOWN


def report(message="CUDA out of memory. Tried to allocate 2.00 GiB"):
    return FailureReport(
        reason=FailureReason.GPU_OUT_OF_MEMORY,
        phase=Phase.BACKWARD,
        step=3,
        message=message,
        exit_code=EXIT_GPU_OOM,
        peak_allocated_bytes=70 * 2**30,
        peak_reserved_bytes=75 * 2**30,
        device_total_bytes=80 * 2**30,
        micro_batch_size=4,
        sequence_length=4096,
        rank=0,
    )


def test_report_round_trips_through_termination_message():
    text = report().to_termination_message()
    data = json.loads(text)
    assert data["reason"] == "GPUOutOfMemory" and data["peakAllocatedBytes"] == 70 * 2**30
    assert parse_failure_report(text) == report()


@pytest.mark.parametrize("message", ["x" * 10_000, "ü\"\n" * 5_000, "\x00" * 3000])
def test_long_message_is_truncated_to_fit(message):
    text = report(message).to_termination_message()
    assert len(text.encode()) <= TERMINATION_MESSAGE_LIMIT
    parsed = parse_failure_report(text)
    assert parsed.reason is FailureReason.GPU_OUT_OF_MEMORY
    assert parsed.message.endswith("[truncated]") and len(parsed.message) > 100


def test_parse_ignores_log_tails():
    assert parse_failure_report("") is None
    assert parse_failure_report("Traceback ...\ntorch.OutOfMemoryError: CUDA out of memory") is None
    assert parse_failure_report('{"reason": "Nope"}') is None


def test_contract_imports_without_torch():
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "import finetune_trainer.contract, finetune_trainer\n"
        "assert 'transformers' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)

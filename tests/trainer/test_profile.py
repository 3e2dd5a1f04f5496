"""The pre-flight profile on a tiny model (CPU, fake tensors): the figures the planner extrapolates
from agree with a trace of the setup itself, and a model that cannot be built says why."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("peft")

from finetune_trainer import profile as P  # noqa: E402
from finetune_trainer.contract import ProfileRequest, ProfileReport, ProfileSetup, parse_profile_report  # noqa: E402

# A family the analytic memory model does not know (Falcon: fused query_key_value, parallel attention, LayerNorm,
# a GELU MLP; GPT-NeoX was the example until issue 28 made it analytic), one block.
CONFIG = {"model_type": "falcon", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 256,
          "num_hidden_layers": 1, "num_attention_heads": 4, "max_position_embeddings": 1024}
TEMPLATE = ProfileSetup(method="lora", lora_rank=8, lora_dropout=0.05, sequence_length=128, micro_batch_size=1,
                        gradient_checkpointing=True, strategy="fsdp", world_size=1)


def test_profiled_corners_bound_an_inside_setup_within_two_percent():
    from finetune_operator.profiling.estimate import profiled_architecture
    from finetune_operator.profiling.setups import JobProfile
    from finetune_operator.sizing import TrainingSetup, estimate_memory

    profile = JobProfile(TEMPLATE, ("fsdp",), (True,), (1, 4), (1, 4))
    report = P.run_profile(ProfileRequest(config=CONFIG, setups=profile.setups()))
    assert report.ok, report.error
    assert parse_profile_report(report.to_termination_message()) == report  # fits the 4096-byte message
    assert report.shape.model_type == "falcon" and report.params["total"] > 0
    arch = profiled_architecture(report, profile, {m.key: m for m in report.measurements}, "tiny")
    inside = TEMPLATE.model_copy(update=dict(world_size=2, micro_batch_size=2))
    truth = P.measure(CONFIG, inside)
    est = estimate_memory(TrainingSetup(architecture=arch, method="lora", lora_rank=8, lora_dropout=0.05,
                                        sequence_length=128, micro_batch_size=2, gradient_checkpointing=True,
                                        strategy="fsdp", world_size=2))
    err = (est.peak_allocated_bytes - truth.peak_bytes) / truth.peak_bytes
    assert 0 <= err <= 0.02, f"estimate {est.peak_allocated_bytes} vs trace {truth.peak_bytes} ({err:+.2%})"


@pytest.mark.parametrize("config, setup_change, field, words", [
    (dict(CONFIG, model_type="no-such-family"), {}, "model_type", "not known to transformers"),
    (CONFIG, {"lora_targets": ["q_proj"]}, "spec.lora.targetModules", "q_proj"),
    (dict(CONFIG, num_attention_heads=3), {}, "config", "cannot"),  # 64 / 3: the config class refuses it
    (dict(CONFIG, num_attention_heads=5), {}, "config", "divisible"),  # 64 / 5: the model's own __init__ does
])
def test_a_model_that_cannot_be_built_is_a_report_naming_why(config, setup_change, field, words):
    report = P.run_profile(ProfileRequest(config=config, setups=[TEMPLATE.model_copy(update=setup_change)]))
    assert not report.ok and report.error_field == field and words in report.error
    assert len(report.to_termination_message().encode()) <= 4096


def test_the_entry_point_writes_its_report_and_exits_config_error_on_failure(tmp_path, monkeypatch):
    path = tmp_path / "termination-log"
    request = ProfileRequest(config=dict(CONFIG, model_type="no-such-family"), setups=[TEMPLATE])
    monkeypatch.setenv("FINETUNE_PROFILE_REQUEST", request.model_dump_json(by_alias=True))
    assert P.main([f"--report-path={path}"]) == 78
    assert ProfileReport.model_validate_json(path.read_text()).error_field == "model_type"
    monkeypatch.setenv("FINETUNE_PROFILE_REQUEST", "{}")
    assert P.main([f"--report-path={path}"]) == 78
    assert "no valid profile request" in ProfileReport.model_validate_json(path.read_text()).error

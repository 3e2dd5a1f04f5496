"""FineTuneJob -> TrainingSetup, and the `estimate` subcommand."""

import copy
from dataclasses import replace
import json
from pathlib import Path

import pytest
import yaml

from finetune_operator import api
from finetune_operator.cli import main
from finetune_operator.sizing import PRESETS, SizingError, TrainingSetup, estimate_memory
from finetune_operator.sizing.from_job import setup_from_job

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "llama-8b-lora.yaml"


def _doc() -> dict:
    return yaml.safe_load(EXAMPLE.read_text())


def _fixed(doc: dict) -> dict:
    doc = copy.deepcopy(doc)
    doc["spec"]["resources"].update(gpus=4, strategy="fsdp", offload="none")
    doc["spec"]["training"].update(microBatchSize=2, gradientCheckpointing=True, optimizerInBackward=False,
                                   activationOffloading=False, lossChunks=4, sequenceParallel=1)
    return doc


def test_fixed_job_maps_exactly_and_without_notes():
    job = api.parse_job(_fixed(_doc()))
    js = setup_from_job(job)
    assert js.notes == ()
    assert js.setup == TrainingSetup(
        architecture=PRESETS["llama-3.1-8b"], method="lora", lora_rank=16, lora_targets="all-linear",
        lora_dropout=0.05, precision="bf16", optimizer="adamw", micro_batch_size=2, sequence_length=4096,
        gradient_checkpointing=True, attention="sdpa", strategy="fsdp", world_size=4, offload="none",
        loss_chunks=4, gradient_accumulation=1,
    )


def test_auto_fields_use_documented_defaults_and_say_so():
    js = setup_from_job(api.parse_job(_doc()))
    assert js.setup.world_size == 1 and js.setup.strategy == "ddp" and js.setup.micro_batch_size == 1
    assert js.setup.gradient_checkpointing is True and js.setup.offload == "none"
    text = " ".join(js.notes)
    for field in ("resources.gpus", "resources.strategy", "training.microBatchSize",
                  "training.gradientCheckpointing", "resources.offload", "training.optimizerInBackward",
                  "training.activationOffloading"):
        assert field in text


def test_inline_architecture():
    doc = _fixed(_doc())
    doc["spec"]["model"]["architecture"] = {"inline": {
        "model_type": "qwen2", "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
        "num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 151936, "tie_word_embeddings": True}}
    js = setup_from_job(api.parse_job(doc))
    assert js.setup.architecture.total_params == PRESETS["qwen2.5-0.5b"].total_params


def test_config_map_architecture_needs_the_config():
    doc = _fixed(_doc())
    doc["spec"]["model"]["architecture"] = {"configMapRef": {"name": "llama-config"}}
    job = api.parse_job(doc)
    with pytest.raises(SizingError, match="configMapRef"):
        setup_from_job(job)
    config = PRESETS["llama-3.1-8b"].to_hf_config()
    assert setup_from_job(job, config).setup.architecture.total_params == PRESETS["llama-3.1-8b"].total_params


def test_estimate_json_contract(tmp_path, capsys):
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(_fixed(_doc())))
    assert main(["estimate", str(path), "-o", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    per = doc["perGPU"]
    assert set(per["breakdown"]) >= {"weights", "gradients", "optimizer", "activations", "logits", "buffers"}
    expected = estimate_memory(setup_from_job(api.parse_job(_fixed(_doc()))).setup)
    assert per["peakAllocatedBytes"] == expected.peak_allocated_bytes
    assert per["requiredBytes"] == expected.required_bytes
    assert per["peakPhase"] == expected.peak_phase
    assert doc["host"]["requiredBytes"] == expected.host_required_bytes
    assert doc["notes"] == []


def test_estimate_table_lists_terms_in_gib(tmp_path, capsys):
    path = tmp_path / "job.yaml"
    path.write_text(EXAMPLE.read_text())
    assert main(["estimate", str(path)]) == 0
    out = capsys.readouterr().out
    assert "weights" in out and "GiB" in out and "required" in out
    assert "note: resources.gpus is auto" in out


def test_estimate_unknown_preset_is_a_clear_error(tmp_path, capsys):
    doc = _doc()
    doc["spec"]["model"]["architecture"] = {"preset": "llama-9"}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(doc))
    assert main(["estimate", str(path)]) == 2
    err = capsys.readouterr().err
    assert "llama-9" in err and "llama-3.1-8b" in err


def test_packing_reaches_the_setup_and_costs_the_mask_under_sdpa_only():
    """spec.dataset.packing: under sdpa every block gets the block-diagonal mask (its bias and
    repeat_kv's key/value copies are saved); flash reads the boundaries itself and eager always has
    a mask, so neither costs more packed."""
    doc = _fixed(_doc())
    doc["spec"]["dataset"]["packing"] = True
    packed = setup_from_job(api.parse_job(doc)).setup
    assert packed.packing and not setup_from_job(api.parse_job(_fixed(_doc()))).setup.packing
    peak = {}
    for attention in ("sdpa", "flash", "eager"):
        for packing in (False, True):
            setup = replace(packed, attention=attention, packing=packing, gradient_checkpointing=False)
            peak[attention, packing] = estimate_memory(setup).peak_allocated_bytes
    assert peak["sdpa", True] > peak["sdpa", False]
    assert peak["flash", True] == peak["flash", False] and peak["eager", True] == peak["eager", False]
    # Llama 3.1 8B, 2 x 4096 tokens, nothing recomputed: each of the 32 blocks saves the mask's bias
    # (2 x 4096^2 x 2 bytes) and key/value copies for 32 query heads instead of 8.
    arch = packed.architecture
    bias = 2 * 2 * 4096 ** 2
    copies = 2 * 2 * (arch.q_size - arch.kv_size) * 2 * 4096
    assert peak["sdpa", True] - peak["sdpa", False] >= 32 * (bias + copies)

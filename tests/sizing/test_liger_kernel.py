"""Liger's kernels (training.ligerKernel), the lever landed through the registry: its memory term
(what liger-kernel 0.8.5's fused RMSNorm, SwiGLU and fused linear cross-entropy keep), where the
planner uses it (only where the job asks), what it refuses, and what it turns off.

The term is checked here against figures worked out by hand from liger-kernel's source; no GPU
runs it here (Triton), so bench/gpu_levers.py measures it on a lent device."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import triton

from finetune_operator import api
from finetune_operator.planning import ClusterPolicy, Plan, load_catalog, plan_job
from finetune_operator.sizing import SizingError, TrainingSetup, estimate_memory
from finetune_operator.sizing.activations import logits_bytes, saved_activations
from finetune_operator.sizing.from_job import setup_from_job
from finetune_operator.sizing.presets import preset
from finetune_operator.sizing.regime import regime_of
from finetune_trainer import combinations
from finetune_trainer.memory_levers import BY_NAME, Levers, lever_ask, lever_options

L1B = preset("llama-3.2-1b")  # vocab 128256, hidden 2048, intermediate 8192, 16 layers
REGION = "eu-de-berlin"
POLICY = ClusterPolicy(allowed_regions=[REGION])


def _setup(**changes: Any) -> TrainingSetup:
    fields = dict(architecture=L1B, method="lora", micro_batch_size=2, sequence_length=2048, lora_dropout=0.0)
    return TrainingSetup(**{**fields, **changes})


def test_the_fused_norms_and_swiglu_keep_what_liger_saves_for_backward():
    for setup in (_setup(), _setup(method="full"), _setup(method="full", strategy="fsdp", world_size=2)):
        regime = regime_of(setup)
        plain = saved_activations(setup, regime)
        liger = saved_activations(replace(setup, liger_kernel=True), regime)
        hidden, inter = L1B.hidden_size, L1B.intermediate_size
        # LigerRMSNorm keeps its input as it came and 1/rms (fp32); the plain norm an fp32 copy of its
        # input and, when its weight trains, the normalised value. LigerSiLUMulFunction keeps gate and up.
        plain_norm = 4 * hidden + (regime.residual * hidden if regime.weights_trainable else 0)
        liger_norm = regime.residual * hidden + 4
        assert plain.block_per_token - liger.block_per_token == 2 * (plain_norm - liger_norm) + regime.mlp * inter
        tokens = 2 * 2048
        # Around the blocks: Liger's final norm, and no saved input of the head (its gradient is made in forward).
        assert liger.around == (liger_norm + regime.residual * hidden) * tokens
        assert liger.shared == plain.shared  # RoPE keeps cos and sin, as the plain rotation does


def test_the_fused_loss_works_on_liger_chunks_and_keeps_its_gradients_from_the_forward():
    vocab, hidden = L1B.vocab_size, L1B.hidden_size
    for micro, seq in ((2, 2048), (1, 100), (1, 4)):
        setup = _setup(micro_batch_size=micro, sequence_length=seq, liger_kernel=True)
        regime = regime_of(setup)
        tokens = micro * seq
        # liger_kernel/ops/fused_linear_cross_entropy.py: chunk_size, with triton's own helpers.
        chunk = min(triton.next_power_of_2(triton.cdiv(tokens, triton.cdiv(vocab, hidden))), tokens)
        forward, backward = logits_bytes(L1B, setup, regime)
        # LoRA: a frozen head (no weight gradient), bf16 input: input + its gradient + loss_1d + mask,
        # one chunk's logits and input gradient in bf16.
        assert forward * tokens == pytest.approx((2 * hidden + 2 * hidden + 5) * tokens + chunk * (vocab + hidden) * 2)
        assert backward == 2 * hidden
    # 2 x 2048 tokens of Llama 3.2: ceil(4096 / 63) = 66 rounds up to chunks of 128 tokens, 32 of them
    # (31 MiB of bf16 logits each), not 2 GiB of fp32 log-softmax.
    assert min(triton.next_power_of_2(triton.cdiv(4096, triton.cdiv(vocab, hidden))), 4096) == 128


def test_full_fine_tuning_keeps_the_heads_whole_weight_gradient_from_the_forward():
    vocab, hidden = L1B.vocab_size, L1B.hidden_size
    tokens = 2 * 2048
    full = _setup(method="full", liger_kernel=True)  # ddp: fp32 weights under autocast, fp32 residual
    forward, backward = logits_bytes(L1B, full, regime_of(full))
    weight_grad = vocab * hidden * 4  # zeros_like(the fp32 head)
    chunk = 128
    # ... and under autocast the per-chunk bf16 cast of weight.t() (a view: not in autocast's cache).
    assert forward * tokens == pytest.approx((4 * hidden + 4 * hidden + 5) * tokens + chunk * (vocab + hidden) * 2
                                             + 2 * vocab * hidden + weight_grad)
    assert backward * tokens == pytest.approx(4 * hidden * tokens + weight_grad)
    bf16 = _setup(method="full", master_weights="bf16", liger_kernel=True)
    assert logits_bytes(L1B, bf16, regime_of(bf16))[1] * tokens == pytest.approx(2 * hidden * tokens + vocab * hidden * 2)


def test_liger_lowers_the_peak_where_the_logits_or_the_mlp_dominate():
    for setup in (_setup(), _setup(gradient_checkpointing=True), _setup(method="full")):
        plain = estimate_memory(setup)
        liger = estimate_memory(replace(setup, liger_kernel=True))
        chunked = estimate_memory(replace(setup, loss_chunks=8))
        assert liger.peak_allocated_bytes < min(plain.peak_allocated_bytes, chunked.peak_allocated_bytes), setup
    # The chunked loss's saving and Liger's are the logits: the plain loss's 2 GiB of fp32 log-softmax go.
    lora = _setup()
    assert estimate_memory(lora).peak_allocated_bytes - estimate_memory(replace(lora, liger_kernel=True)) \
        .peak_allocated_bytes > 1.5 * 2**30


def test_families_whose_kernels_are_not_modelled_are_refused_naming_the_field():
    for name in ("mixtral-8x7b", "gemma-2-9b", "qwen3-8b", "phi-3-mini"):
        setup = TrainingSetup(architecture=preset(name).with_layers(2), method="lora", liger_kernel=True, lora_dropout=0.0)
        with pytest.raises(SizingError) as error:
            estimate_memory(setup)
        assert error.value.field == "liger_kernel" and "llama, mistral, qwen2" in str(error.value)
    estimate_memory(TrainingSetup(architecture=preset("qwen2.5-7b").with_layers(2), liger_kernel=True, lora_dropout=0.0))


def test_the_rules_name_the_field_to_change():
    refused = combinations.violations(combinations.Choices(liger_kernel=True, chunked_loss=True))
    assert [(v.rule, v.field) for v in refused] == [("liger-chunked-loss", "chunked_loss")]
    refused = combinations.violations(combinations.Choices(liger_kernel=True, strategy="zero3"))
    assert [(v.rule, v.field) for v in refused] == [("liger-zero3", "liger_kernel")]
    assert combinations.allows(combinations.Choices(liger_kernel=True, strategy="fsdp", chunked_loss=False))


def test_the_crd_tests_liger_with_zero3_and_leaves_the_chunked_loss_rule_to_the_validator():
    rules = api.FineTuneJobSpec.model_json_schema()["x-kubernetes-validations"]
    liger = [r for r in rules if "ligerKernel" in r["rule"]]
    assert [r["fieldPath"] for r in liger] == [".training.ligerKernel"] and "'zero3'" in liger[0]["rule"]
    # lossChunks is a number: no generated rule compares it with a boolean (chunked_loss is derived).
    assert not any("self.training.lossChunks in [" in r["rule"] for r in rules)


def test_the_planner_turns_it_on_only_where_the_job_asks_and_then_without_the_chunked_loss():
    class _Training:
        master_weights, update_rounding, precision, optimizer = "auto", "auto", "bf16", "adamw"
        optimizer_in_backward, loss_chunks, activation_offloading, liger_kernel = None, "auto", None, None
        sequence_parallel = 1

    base = combinations.Choices(method="lora", strategy="ddp", offload="none", optimizer="adamw", precision="bf16",
                                gradient_checkpointing=True, gradient_accumulation=4, gradient_clipping=True)
    unset = lever_options(lever_ask(_Training(), "lora", False), base, accumulation_one=False,
                          allows=combinations.allows)
    assert {levers.liger_kernel for levers in unset} == {False}
    _Training.liger_kernel = True
    ask = lever_ask(_Training(), "lora", False)
    assert "liger_kernel" in ask.fixed
    asked = lever_options(ask, base, accumulation_one=False, allows=combinations.allows)
    # lossChunks auto would be 8: Liger's fused loss does its work, so it is off (once, not per chunk count).
    assert asked == (Levers(liger_kernel=True, loss_chunks=1), Levers(liger_kernel=True, loss_chunks=1,
                                                                      activation_offloading=True))


def _lora_8b(**training: Any) -> api.FineTuneJobSpec:
    return api.parse_spec({
        "model": {"name": "m", "architecture": {"preset": "llama-3.1-8b"}, "source": {"pvc": {"claimName": "m"}}},
        "dataset": {"source": {"pvc": {"claimName": "d", "path": "t.jsonl"}}},
        "method": "lora",
        "lora": {"rank": 16},
        "training": {"sequenceLength": 8192, "globalBatchSize": 8, "maxSteps": 10, **training},
        "resources": {"gpus": "auto", "maxGPUs": 8},
        "placement": {"regions": [REGION]},
    })


def _pools(gpu: str) -> list:
    return load_catalog({"pools": [{"name": "p", "region": REGION, "gpuType": gpu, "gpusPerNode": 8, "maxNodes": 1,
                                    "pricePerGpuHour": 1.0, "hostMemory": "1000Gi"}]})


def test_a_plan_uses_liger_only_when_asked_and_says_what_it_saves():
    plain = plan_job(_lora_8b(), _pools("L4-24GB"), POLICY)
    assert isinstance(plain, Plan) and not plain.liger_kernel
    asked = plan_job(_lora_8b(ligerKernel=True), _pools("L4-24GB"), POLICY)
    assert isinstance(asked, Plan), asked
    assert asked.liger_kernel and asked.loss_chunks == 1
    assert asked.lever_savings_bytes["liger_kernel"] > 0 and "Liger kernels" in asked.summary()
    status = asked.to_status()
    assert status.liger_kernel is True and status.lever_savings["ligerKernel"] > 0
    assert "liger_kernel" not in asked.changes  # asked for: no change


def test_the_api_refuses_what_cannot_run_naming_the_field():
    with pytest.raises(api.JobValidationError, match=r"spec\.training\.lossChunks"):
        _lora_8b(ligerKernel=True, lossChunks=8)
    with pytest.raises(api.JobValidationError, match=r"spec\.training\.ligerKernel"):
        api.parse_spec({**_lora_8b().model_dump(by_alias=True, exclude_none=True, mode="json"),
                        "method": "full", "lora": None,
                        "training": {"sequenceLength": 2048, "globalBatchSize": 8, "maxSteps": 10, "ligerKernel": True},
                        "resources": {"gpus": 2, "strategy": "zero3"}})
    assert _lora_8b(ligerKernel=True, lossChunks=1).training.liger_kernel is True


def test_estimating_a_job_as_it_stands_turns_the_chunked_loss_off_with_a_note():
    job = setup_from_job(_lora_8b(ligerKernel=True))
    setup, notes = job.setup, job.notes
    assert setup.liger_kernel and setup.loss_chunks == 1
    assert "training.lossChunks: off (replaced by Liger's kernels)" in notes, notes
    job = setup_from_job(_lora_8b())
    setup, notes = job.setup, job.notes
    assert not setup.liger_kernel and setup.loss_chunks == 8
    assert not any("ligerKernel" in n or "lossChunks" in n for n in notes), notes  # unset is off: nothing to say
    assert BY_NAME["liger_kernel"].rung is None  # recovery never frees it (the planner cannot choose it)

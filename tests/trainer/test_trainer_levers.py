"""The lean-trainer levers, in process on tiny models built from a config (issue 13).

bf16 master weights and their rounding (bf16_adamw.py), the optimizer step in backward
(optimizer_in_backward.py), chunked cross-entropy (chunked_loss.py), activation
offloading (activation_offload.py), LoRA on fused expert weights (moe.py), the QLoRA
FSDP route (model_setup.py) and the levers line (levers.py). The end-to-end runs of the
trainer with the levers on are in test_trainer_levers_runs.py.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

from finetune_trainer.bf16_adamw import BF16AdamW, stochastic_round_to_bf16
from finetune_trainer.chunked_loss import ChunkedLoss, shift_labels
from finetune_trainer.contract import TrainerConfig
from finetune_trainer.errors import ConfigError


def tiny_llama(seed: int = 0, layers: int = 2, hidden: int = 32, vocab: int = 61, dtype=torch.float32):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         tie_word_embeddings=False)
    return LlamaForCausalLM(config).to(dtype)


def config(**overrides) -> TrainerConfig:
    base = {"jobName": "t", "model": {"path": "/m"}, "dataset": {"path": "/d"}, "method": "full", "maxSteps": 3,
            "outputDirectory": "/tmp/out"}
    base.update(overrides)
    return TrainerConfig.model_validate(base)


# ------------------------------------------------------------------ bf16 master weights


def test_stochastic_rounding_picks_a_neighbour_and_is_unbiased():
    torch.manual_seed(0)
    value = torch.full((200_000,), 1.0 + 3 * 2.0 ** -10)  # between bf16 neighbours 1.0 and 1.0078125
    down, up = torch.tensor(1.0), torch.tensor(1.0 + 2.0 ** -7)
    rounded = stochastic_round_to_bf16(value).float()
    assert set(rounded.unique().tolist()) == {down.item(), up.item()}
    # P(up) = 3/8 exactly in expectation; 200k draws: standard error 0.0011.
    assert (rounded == up).float().mean().item() == pytest.approx(3 / 8, abs=0.006)
    assert rounded.mean().item() == pytest.approx(value[0].item(), abs=1e-4)
    negative = stochastic_round_to_bf16(-value).float()
    assert negative.mean().item() == pytest.approx(-value[0].item(), abs=1e-4)
    # Round to nearest would always give 1.0: the bias stochastic rounding removes.
    assert value.bfloat16().float().unique().tolist() == [1.0]


def test_bf16_adamw_on_fp32_weights_is_torch_adamw():
    """The update rule itself: on fp32 tensors (nothing to round) it is decoupled AdamW."""
    torch.manual_seed(1)
    ours, theirs = torch.randn(64, 8, requires_grad=True), None
    theirs = ours.detach().clone().requires_grad_(True)
    opt_ours = BF16AdamW([ours], lr=1e-2, weight_decay=0.1)
    opt_theirs = torch.optim.AdamW([theirs], lr=1e-2, weight_decay=0.1)
    for step in range(5):
        grad = torch.randn(64, 8)
        ours.grad, theirs.grad = grad.clone(), grad.clone()
        opt_ours.step()
        opt_theirs.step()
    assert torch.allclose(ours, theirs, atol=1e-6)


@pytest.mark.parametrize("rounding", ["stochastic", "kahan"])
def test_updates_below_half_a_bf16_ulp_survive_compensated_rounding(rounding):
    """lr 1e-4 on weights of 1.0: each step moves a weight by ~1e-4, under half of bf16's
    spacing at 1.0 (2**-7 = 0.0078). Round-to-nearest loses every update; Kahan and
    stochastic rounding keep them (in sum, or in expectation)."""
    results = {}
    for mode in ("nearest", rounding):
        torch.manual_seed(2)
        weight = torch.ones(4096, dtype=torch.bfloat16, requires_grad=True)
        opt = BF16AdamW([weight], lr=1e-4, rounding=mode, seed=3)
        for _ in range(40):
            weight.grad = torch.ones_like(weight)  # Adam's step is then -lr per element
            opt.step()
        results[mode] = weight.float().mean().item()
    expected = 1.0 - 40 * 1e-4
    assert results["nearest"] == 1.0
    assert results[rounding] == pytest.approx(expected, abs=1e-3)
    assert weight.dtype == torch.bfloat16
    state = opt.state[weight]
    assert state["exp_avg"].dtype == torch.bfloat16 and state["exp_avg_sq"].dtype == torch.bfloat16
    assert ("kahan_comp" in state) == (rounding == "kahan")


@pytest.mark.parametrize("rounding", ["nearest", "stochastic", "kahan"])
def test_sliced_updates_equal_whole_parameter_updates(rounding):
    """Large parameters are updated in slices (bounded fp32 temporaries): same result."""
    torch.manual_seed(8)
    whole = torch.randn(1000, dtype=torch.bfloat16, requires_grad=True)
    sliced = whole.detach().clone().requires_grad_(True)
    opts = [BF16AdamW([whole], lr=1e-2, weight_decay=0.1, rounding=rounding, seed=1),
            BF16AdamW([sliced], lr=1e-2, weight_decay=0.1, rounding=rounding, seed=1, slice_elements=64)]
    for _ in range(3):
        grad = torch.randn(1000, dtype=torch.bfloat16)
        whole.grad, sliced.grad = grad.clone(), grad.clone()
        for opt in opts:
            opt.step()
    assert torch.equal(whole, sliced)
    for key in opts[0].state[whole]:
        assert torch.equal(opts[0].state[whole][key], opts[1].state[sliced][key]), key


def _losses(model, optimizer, batches, autocast: bool) -> list[float]:
    losses = []
    for ids in batches:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def test_bf16_master_loss_curve_stays_close_to_fp32_master():
    """20 AdamW steps (lr 3e-3) of a tiny Llama on a fixed, learnable token stream; the
    fp32-master curve (fp32 weights and moments, bf16 autocast) falls from 4.15 to 2.14.

    Measured (bench/lean_levers_cpu.py prints it, also for 100 steps): fp32 master with
    and without autocast differ by 4e-4; bf16 master with stochastic or Kahan rounding
    stays within 3.3e-3 of the fp32-master curve; round-to-nearest lags behind, 0.087
    higher after 20 steps (updates below half a bf16 ulp are lost). Tolerance for the
    compensated curves: 0.02, six times their measured gap and four times smaller than
    the lag of uncompensated rounding, so a compensation that stopped working fails."""
    torch.manual_seed(0)
    pattern = torch.randint(0, 61, (32,))
    batches = [torch.stack([pattern.roll(int(s)) for s in torch.randint(0, 32, (4,))]) for _ in range(20)]
    reference_model = tiny_llama()
    reference = _losses(reference_model, torch.optim.AdamW(reference_model.parameters(), lr=3e-3), batches, True)
    assert reference[-1] < reference[0] - 1.5, reference
    gaps = {}
    for rounding in ("nearest", "stochastic", "kahan"):
        model = tiny_llama(dtype=torch.bfloat16)
        curve = _losses(model, BF16AdamW(model.parameters(), lr=3e-3, rounding=rounding), batches, False)
        assert curve[-1] < curve[0] - 1.5, (rounding, curve)
        gaps[rounding] = max(abs(a - b) for a, b in zip(curve, reference))
    assert gaps["stochastic"] < 0.02 and gaps["kahan"] < 0.02, gaps
    assert 0.02 < gaps["nearest"] < 0.2, gaps


def test_kahan_buffers_are_optimizer_state_and_resume_exactly():
    torch.manual_seed(4)
    weight = torch.randn(256, dtype=torch.bfloat16, requires_grad=True)
    grads = [torch.randn(256, dtype=torch.bfloat16) for _ in range(6)]
    opt = BF16AdamW([weight], lr=1e-3, rounding="kahan")
    for grad in grads[:3]:
        weight.grad = grad
        opt.step()
    saved_weight, saved = weight.detach().clone(), copy.deepcopy(opt.state_dict())
    assert saved["state"][0]["kahan_comp"].abs().sum() > 0  # it holds what rounding lost
    for grad in grads[3:]:
        weight.grad = grad
        opt.step()
    resumed = saved_weight.clone().requires_grad_(True)
    opt2 = BF16AdamW([resumed], lr=1e-3, rounding="kahan")
    opt2.load_state_dict(saved)
    for grad in grads[3:]:
        resumed.grad = grad
        opt2.step()
    assert torch.equal(resumed, weight)


# ------------------------------------------------------------ optimizer step in backward


def test_optimizer_in_backward_equals_a_normal_step_and_frees_gradients():
    from torch.optim.lr_scheduler import LambdaLR

    from finetune_trainer.optimizer_in_backward import InBackwardOptimizer

    torch.manual_seed(5)
    ids = [torch.randint(0, 61, (2, 12)) for _ in range(4)]
    plain_model, hooked_model = tiny_llama(), tiny_llama()
    plain = torch.optim.AdamW(plain_model.parameters(), lr=1e-2, weight_decay=0.01)
    hooked = InBackwardOptimizer([(n, p, 0.01) for n, p in hooked_model.named_parameters()],
                                 lambda groups: torch.optim.AdamW(groups, lr=1e-2))
    schedules = [LambdaLR(opt, lambda step: 1 / (1 + step)) for opt in (plain, hooked)]
    # A load_state_dict (accelerate does one) replaces the optimizers' group dicts: the
    # scheduler must still reach the ones in use.
    hooked.load_state_dict(hooked.state_dict())
    for batch in ids:
        plain_model(input_ids=batch, labels=batch).loss.backward()
        plain.step()
        plain.zero_grad()
        hooked_model(input_ids=batch, labels=batch).loss.backward()
        assert all(p.grad is None for p in hooked_model.parameters())  # applied and freed in backward
        hooked.step()  # nothing left to do
        for schedule in schedules:
            schedule.step()
    assert hooked.steps_in_backward == 4 * len(list(hooked_model.parameters()))
    for (name, a), b in zip(plain_model.named_parameters(), hooked_model.parameters()):
        assert torch.allclose(a, b, atol=1e-6), name
    assert [g["lr"] for g in hooked.param_groups][:1] == [g["lr"] for g in plain.param_groups][:1]


# ------------------------------------------------------------------ chunked cross-entropy


@pytest.mark.parametrize("chunks", [1, 3, 4, 17])
def test_chunked_loss_equals_the_plain_loss_with_masks_and_shared_token_count(chunks):
    """Two micro-batches of one optimizer step, normalised by the labelled-token count of
    both (as the Trainer's num_items_in_batch): the chunked loss and its gradients equal
    transformers' own loss. 17 chunks of a 15-token sequence: chunks of 1 and empty ones."""
    torch.manual_seed(6)
    model = tiny_llama()
    micro = []
    for _ in range(2):
        ids = torch.randint(0, 61, (3, 15))
        labels = ids.clone()
        labels[:, :4] = -100  # a prompt
        labels[1, 9:] = -100  # padding
        labels[2] = -100  # a sequence with nothing to learn
        micro.append((ids, labels))
    items = sum(shift_labels(labels).ne(-100).sum() for _, labels in micro)
    for ids, labels in micro:
        model(input_ids=ids, labels=labels, num_items_in_batch=items).loss.backward()
    reference_loss = sum(model(input_ids=i, labels=l, num_items_in_batch=items).loss.item() for i, l in micro)
    reference = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    chunked = ChunkedLoss(model, chunks)
    total = 0.0
    for ids, labels in micro:
        loss = chunked.loss(model, {"input_ids": ids, "labels": labels}, items)
        loss.backward()
        total += loss.item()
    assert total == pytest.approx(reference_loss, rel=1e-6)
    for name, param in model.named_parameters():
        assert torch.allclose(param.grad, reference[name], atol=1e-6), name
    # Without the trainer arming it, the head still gives plain logits (evaluation, generation).
    assert model(input_ids=micro[0][0]).logits.shape == (3, 15, 61)


def test_chunked_loss_without_a_shared_count_is_this_micro_batch_mean():
    model = tiny_llama()
    ids = torch.randint(0, 61, (2, 10))
    labels = ids.clone()
    labels[0, :5] = -100
    plain = model(input_ids=ids, labels=labels).loss
    chunked = ChunkedLoss(model, 2).loss(model, {"input_ids": ids, "labels": labels}, None)
    assert chunked.item() == pytest.approx(plain.item(), rel=1e-6)


def test_chunked_loss_refuses_models_that_change_logits_after_the_head():
    from transformers import Gemma2Config, Gemma2ForCausalLM

    model = Gemma2ForCausalLM(Gemma2Config(vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                           num_attention_heads=2, num_key_value_heads=1, head_dim=8))
    with pytest.raises(ValueError, match="final_logit_softcapping"):
        ChunkedLoss(model, 4)


# ----------------------------------------------------------------- activation offloading


def test_activation_offloading_moves_the_checkpointed_inputs_and_keeps_gradients():
    from finetune_trainer import activation_offload

    model = tiny_llama(layers=3)
    model.train()
    ids = torch.randint(0, 61, (2, 16))

    def grads():
        model.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
        return [p.grad.clone() for p in model.parameters()]

    plain = grads()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    stats = activation_offload.install(model)
    offloaded = grads()
    assert all(torch.equal(a, b) for a, b in zip(plain, offloaded))
    # Exactly each checkpointed layer's input hidden state went to the host and came back.
    assert stats.tensors == 3 and stats.bytes == 3 * 2 * 16 * 32 * 4
    assert stats.peak_live_bytes == stats.bytes and stats.live_bytes == 0


def test_activation_offloading_without_checkpointing_is_refused():
    from finetune_trainer import activation_offload

    with pytest.raises(ValueError, match="no checkpointed layer"):
        activation_offload.install(tiny_llama())


# ------------------------------------------------------------------ LoRA on MoE experts


def tiny_moe(family: str):
    torch.manual_seed(7)
    if family == "mixtral":
        from transformers import MixtralConfig, MixtralForCausalLM

        return MixtralForCausalLM(MixtralConfig(vocab_size=50, hidden_size=32, intermediate_size=48,
                                                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                                num_local_experts=4, num_experts_per_tok=2))
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    return Qwen3MoeForCausalLM(Qwen3MoeConfig(vocab_size=50, hidden_size=32, intermediate_size=48,
                                              moe_intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
                                              num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, head_dim=8))


def test_peft_alone_refuses_dropout_with_expert_parameters():
    """The failure this trainer works around (peft 0.17+: ParamWrapper)."""
    from peft import LoraConfig, get_peft_model

    from finetune_trainer.moe import expert_parameter_targets

    model = tiny_moe("mixtral")
    with pytest.raises(ValueError, match="lora_dropout"):
        get_peft_model(model, LoraConfig(r=4, lora_dropout=0.1, target_modules="all-linear",
                                         target_parameters=expert_parameter_targets(model)))


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_lora_targets_fused_experts_with_dropout_on_the_linear_adapters(family):
    from torch import nn

    from finetune_trainer.model_setup import apply_lora
    from finetune_trainer.moe import expert_parameter_targets

    model = tiny_moe(family)
    assert expert_parameter_targets(model) == ["experts.down_proj", "experts.gate_up_proj"]
    cfg = config(method="lora", lora={"rank": 4, "alpha": 8, "dropout": 0.1, "targetExperts": True})
    peft_model = apply_lora(cfg, model)
    trainable = [n for n, p in peft_model.named_parameters() if p.requires_grad]
    assert any("experts" in n and "lora_B" in n for n in trainable)
    dropouts = [m for m in peft_model.modules() if isinstance(m, nn.Dropout) and m.p == 0.1]
    assert len(dropouts) == 2 * 4  # q, k, v, o of 2 layers
    ids = torch.randint(0, 50, (2, 12))
    peft_model.train()
    peft_model(input_ids=ids, labels=ids).loss.backward()
    expert_grads = [p.grad for n, p in peft_model.named_parameters() if "experts" in n and "lora_B" in n]
    assert expert_grads and all(g is not None and g.abs().sum() > 0 for g in expert_grads)


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_a_default_moe_lora_job_trains_with_its_default_dropout(family):
    """A LoRA job left at its defaults (all-linear, dropout 0.05, targetExperts unset): peft
    0.21 wraps the fused experts of "all-linear" by itself and then refuses any dropout; the
    trainer builds it like targetExperts and gives the Linear adapters their dropout back."""
    from torch import nn

    from finetune_trainer.model_setup import apply_lora

    peft_model = apply_lora(config(method="lora", lora={"rank": 4, "alpha": 8}), tiny_moe(family))
    dropouts = [m for m in peft_model.modules() if isinstance(m, nn.Dropout) and m.p == 0.05]
    assert len(dropouts) >= 2 * 4  # at least q, k, v, o of 2 layers
    ids = torch.randint(0, 50, (2, 12))
    peft_model.train()
    peft_model(input_ids=ids, labels=ids).loss.backward()


def test_target_experts_on_a_dense_model_names_the_field():
    from finetune_trainer.levers import check_model

    cfg = config(method="lora", lora={"targetExperts": True})
    with pytest.raises(ConfigError, match="lora.targetExperts: the model has no mixture-of-experts"):
        check_model(cfg, tiny_llama())


# -------------------------------------------------------------------------- QLoRA + FSDP


def test_qlora_under_fsdp_stores_4bit_in_the_compute_dtype_and_uses_accelerate_fsdp():
    from transformers import TrainingArguments

    from finetune_trainer.model_setup import (FSDP_ACCELERATE, FSDP_AT_LOAD, FSDP_NONE, accelerate_fsdp_arguments,
                                              fsdp_route, qlora_quantization)

    qlora = config(method="qlora", strategy="fsdp", offload="optimizer+params")
    assert fsdp_route(qlora, 2) == FSDP_ACCELERATE
    assert fsdp_route(qlora, 1) == FSDP_NONE
    assert fsdp_route(config(method="lora", strategy="fsdp"), 2) == FSDP_AT_LOAD
    assert qlora_quantization(qlora, FSDP_ACCELERATE)["bnb_4bit_quant_storage"] == torch.bfloat16
    assert qlora_quantization(config(method="qlora"), FSDP_NONE)["bnb_4bit_quant_storage"] == torch.uint8
    arguments = accelerate_fsdp_arguments(qlora, FSDP_ACCELERATE)
    # transformers accepts them and hands accelerate FSDP2 with CPU offload.
    plugin = TrainingArguments(output_dir="/tmp/o", use_cpu=True, **arguments)._process_fsdp_args()
    assert (plugin["fsdp_version"], plugin["cpu_offload"], plugin["auto_wrap_policy"]) == \
        (2, True, "TRANSFORMER_BASED_WRAP")
    no_offload = accelerate_fsdp_arguments(config(method="qlora", strategy="fsdp"), FSDP_ACCELERATE)
    assert no_offload["fsdp_config"]["cpu_offload"] is False
    assert accelerate_fsdp_arguments(config(method="lora", strategy="fsdp"), FSDP_AT_LOAD) == {}


# ------------------------------------------------------------------------ the levers line


def test_levers_line():
    from finetune_trainer.levers import StartupLevers

    cfg = config(masterWeights="bf16", updateRounding="kahan", optimizerInBackward=True, maxGradNorm=0,
                 lossChunks=8, gradientCheckpointing=True, activationOffloading=True)
    assert StartupLevers.of(cfg).fields() == {
        "masterWeights": "bf16", "updateRounding": "kahan", "optimizer": "adamw", "optimizerInBackward": True,
        "lossChunks": 8, "gradientCheckpointing": True, "activationOffloading": True, "ligerKernel": False,
        "sequenceParallel": 1, "loraTargetExperts": False, "qloraSharded": False, "offload": False}
    assert StartupLevers.of(config(method="lora")).fields()["masterWeights"] == "fp32 (adapters)"
    assert StartupLevers.of(config(method="qlora", strategy="fsdp")).fields()["qloraSharded"] is True


def test_contract_rules_for_the_levers_name_the_field():
    config(masterWeights="bf16", optimizer="paged-adamw-8bit")  # torchtune's low-memory recipe
    with pytest.raises(ValueError, match="update_rounding"):  # bitsandbytes rounds its own updates
        config(masterWeights="bf16", updateRounding="kahan", optimizer="adamw-8bit")
    with pytest.raises(ValueError, match="optimizer_in_backward"):
        config(optimizerInBackward=True, maxGradNorm=0, gradientAccumulation=2)
    with pytest.raises(ValueError, match="activation_offloading"):
        config(activationOffloading=True)
    assert math.isclose(config(optimizerInBackward=True, maxGradNorm=0).max_grad_norm, 0)

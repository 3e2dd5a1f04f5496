"""The memory model's term for each lever of a lean trainer (issue 13), checked against hand-computed
sizes of what the trainer keeps (bench/sizing_truth.py checks them against fake-tensor traces)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from finetune_operator.sizing.presets import preset
from finetune_operator.sizing import ModelArchitecture, TrainingSetup, estimate_memory
from finetune_operator.sizing import constants as K
from finetune_operator.sizing.memory import lever_savings
from finetune_operator.sizing.optimizer_state import state_bytes, trained_tensors
from finetune_operator.sizing.states import nf4_quant_state_bytes, nf4_weight_quant_state_bytes
from finetune_trainer import optimizers
from finetune_trainer.memory_levers import in_use as levers_in_use

L8 = preset("llama-3.1-8b")
P8 = L8.total_params
EMBED = L8.vocab_size * L8.hidden_size
GIB = 1 << 30
SLICE = min(EMBED, K.BF16_ADAMW_STEP_SLICE_ELEMENTS)  # the bf16 AdamW's fp32 temporaries cover one slice


def test_the_step_slice_is_the_trainers():
    # Read from the trainer's source (importing it would import torch, seconds of CI time).
    import ast
    from pathlib import Path

    source = Path(__file__).resolve().parents[2] / "images" / "trainer" / "finetune_trainer" / "bf16_adamw.py"
    for node in ast.parse(source.read_text()).body:
        if isinstance(node, ast.Assign) and [t.id for t in node.targets if isinstance(t, ast.Name)] == ["STEP_SLICE_ELEMENTS"]:
            value = eval(compile(ast.Expression(node.value), str(source), "eval"), {"__builtins__": {}})  # noqa: S307
            assert K.BF16_ADAMW_STEP_SLICE_ELEMENTS == value
            return
    raise AssertionError("bf16_adamw.py has no STEP_SLICE_ELEMENTS")


def full(**kw) -> TrainingSetup:
    kw.setdefault("architecture", L8)
    kw.setdefault("gradient_checkpointing", True)
    return TrainingSetup(method="full", **kw)


def test_bf16_master_weights_keep_8_bytes_per_parameter_and_no_autocast_copies():
    est = estimate_memory(full(master_weights="bf16"))
    opt = est.phase_peaks["optimizer"]
    # weights, gradients, both moments in bf16; the step's fp32 temporaries of the largest parameter
    assert opt == round(2 * P8 + 2 * P8 + 4 * P8 + K.BF16_ADAMW_STEP_TEMP_BYTES * SLICE)
    fp32 = estimate_memory(full())
    assert fp32.phase_peaks["optimizer"] == round(16 * P8)
    assert est.breakdown["weight_copies"] == 0


def test_kahan_adds_a_bf16_buffer_per_parameter():
    nearest = estimate_memory(full(master_weights="bf16", update_rounding="nearest"))
    kahan = estimate_memory(full(master_weights="bf16", update_rounding="kahan"))
    extra = 2 * P8 + K.BF16_ADAMW_ROUNDING_TEMP_BYTES["kahan"] * SLICE
    assert kahan.phase_peaks["optimizer"] - nearest.phase_peaks["optimizer"] == round(extra)


def test_paged_states_live_in_unified_memory_not_in_the_allocator_peak():
    eight = estimate_memory(full(optimizer="adamw-8bit"))
    paged = estimate_memory(full(optimizer="paged-adamw-8bit"))
    # bitsandbytes' 8-bit states, tensor by tensor (test_optimizer_state.py checks the rule)
    states = state_bytes(optimizers.kind("paged-adamw-8bit"), trained_tensors(L8, "full"), 4.0)
    assert paged.unified_memory_bytes == round(states)
    assert eight.phase_peaks["optimizer"] - paged.phase_peaks["optimizer"] == round(states)
    assert paged.host_required_bytes - eight.host_required_bytes == round(states)
    assert any("unified memory" in note for note in paged.notes)
    assert paged.to_json()["unifiedMemoryBytes"] == paged.unified_memory_bytes


def test_optimizer_in_backward_holds_one_gradient_at_a_time():
    plain = estimate_memory(full(master_weights="bf16"))
    oib = estimate_memory(full(master_weights="bf16", optimizer_in_backward=True))
    assert oib.phase_peaks["optimizer"] == round(6 * P8)  # bf16 weights and both moments, no gradients
    assert oib.breakdown["gradients"] <= 2 * EMBED + 4 * max(lin.params for lin in L8.block_linears())
    # bf16 gradients of every parameter (2 bytes each) no longer exist together: most of that is saved.
    assert plain.peak_allocated_bytes - oib.peak_allocated_bytes > 1.5 * P8


def test_chunked_loss_keeps_one_chunk_of_logits():
    tokens = 2 * 4096
    plain = estimate_memory(full(master_weights="bf16", micro_batch_size=2, sequence_length=4096,
                                 gradient_checkpointing=False))
    chunked = estimate_memory(full(master_weights="bf16", micro_batch_size=2, sequence_length=4096,
                                   gradient_checkpointing=False, loss_chunks=8))
    v = L8.vocab_size
    assert plain.phase_peaks["forward"] - chunked.phase_peaks["forward"] == round(10 * v * tokens - 10 * v * tokens / 8)


def test_activation_offloading_moves_the_checkpointed_inputs_to_host():
    tokens = 2048
    base = full(master_weights="bf16")
    off = replace(base, activation_offloading=True)
    kept = L8.num_layers * 2 * L8.hidden_size * tokens  # bf16 block inputs
    est, est_off = estimate_memory(base), estimate_memory(off)
    assert est_off.activation_offload_bytes == kept
    assert est_off.host_required_bytes - est.host_required_bytes == kept
    assert est.phase_peaks["forward"] - est_off.phase_peaks["forward"] == kept - 2 * L8.hidden_size * tokens


def test_qlora_under_fsdp_shards_the_4bit_base_and_offload_moves_it_to_the_host():
    l70 = preset("llama-2-70b") if "llama-2-70b" in _presets() else preset("llama-3.1-70b")
    ddp = estimate_memory(TrainingSetup(l70, method="qlora", lora_rank=64, gradient_checkpointing=True))
    fsdp = estimate_memory(TrainingSetup(l70, method="qlora", lora_rank=64, gradient_checkpointing=True,
                                         strategy="fsdp", world_size=2))
    off = estimate_memory(TrainingSetup(l70, method="qlora", lora_rank=64, gradient_checkpointing=True,
                                        strategy="fsdp", world_size=2, offload="optimizer+params"))
    linear = l70.linear_params
    trainable = l70.lora_trainable_params(64)
    expected = (K.NF4_PACKED_BYTES_PER_PARAM * linear + 2 * (l70.total_params - linear) + 4 * trainable) / 2
    # FSDP shards the packed 4-bit weights; their quantisation state (no parameter) is whole on each GPU
    state = nf4_quant_state_bytes(l70)
    assert fsdp.breakdown["weights"] == round(expected + state)
    assert fsdp.peak_allocated_bytes < ddp.peak_allocated_bytes / 1.8
    assert off.breakdown["weights"] == state
    assert off.host_required_bytes > fsdp.host_required_bytes + expected * 0.99


@pytest.mark.parametrize("world", [2, 4, 8])
def test_fsdp_qlora_keeps_the_whole_quantisation_state_on_every_gpu(world):
    l70 = preset("llama-3.1-70b")
    one = estimate_memory(TrainingSetup(l70, method="qlora", lora_rank=64, gradient_checkpointing=True,
                                        strategy="fsdp", world_size=world))
    two = estimate_memory(TrainingSetup(l70, method="qlora", lora_rank=64, gradient_checkpointing=True,
                                        strategy="fsdp", world_size=2 * world))
    sharded = one.breakdown["weights"] - nf4_quant_state_bytes(l70)
    # doubling the ranks halves the sharded part only
    assert two.breakdown["weights"] == pytest.approx(sharded / 2 + nf4_quant_state_bytes(l70), abs=2)


@pytest.mark.parametrize("shape", [(4096, 4096), (1024, 4096), (896, 4864), (100, 3)])
def test_nf4_quant_state_matches_bitsandbytes_layout(shape):
    # bitsandbytes' CPU backend quantises as its CUDA one (same blocks, same state tensors).
    torch = pytest.importorskip("torch")
    bnb_functional = pytest.importorskip("bitsandbytes.functional")
    weight = torch.randn(*shape, dtype=torch.bfloat16)
    _, state = bnb_functional.quantize_4bit(weight, blocksize=K.NF4_BLOCKSIZE, quant_type="nf4",
                                            compress_statistics=True, quant_storage=torch.bfloat16)
    tensors = [state.absmax, state.offset, state.code, state.state2.absmax, state.state2.code]
    allocated = sum(-(-t.numel() * t.element_size() // 512) * 512 for t in tensors)
    assert state.blocksize == K.NF4_BLOCKSIZE and state.state2.blocksize == K.NF4_ABSMAX_BLOCKSIZE
    assert nf4_weight_quant_state_bytes(weight.numel()) == allocated


def _presets():
    from finetune_operator.sizing import PRESETS

    return PRESETS


def test_lever_savings_name_each_lever_in_use():
    setup = full(master_weights="bf16", optimizer="paged-adamw-8bit", optimizer_in_backward=True, loss_chunks=8,
                 activation_offloading=True, micro_batch_size=2)
    assert set(levers_in_use(setup)) == {"master_weights", "optimizer_in_backward", "loss_chunks",
                                         "activation_offloading"}
    savings = lever_savings(setup)
    assert set(savings) == set(levers_in_use(setup))
    # Each saves what the peak loses without it; offloading the kept inputs of 32 blocks is not
    # where this setup peaks (the largest gradient's step is), so it saves nothing here.
    assert all(savings[name] > 0 for name in ("master_weights", "optimizer_in_backward", "loss_chunks")), savings
    assert savings["activation_offloading"] >= 0
    assert savings["master_weights"] > 10 * GIB
    assert levers_in_use(full()) == ()
    assert lever_savings(full()) == {}


@pytest.mark.parametrize("rounding", ["stochastic", "kahan"])
def test_rounding_needs_bf16_master_weights(rounding):
    from finetune_operator.sizing import SizingError

    with pytest.raises(SizingError) as error:
        full(update_rounding=rounding)
    assert error.value.field == "update_rounding"

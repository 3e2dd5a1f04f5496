"""The memory model: hand-computed cases, the JSON contract, bad input, speed."""

import json
import math
import time

import pytest

from finetune_operator.sizing.allocator import required_factor
from finetune_operator.sizing import PRESETS, MemoryEstimate, SizingError, TrainingSetup, estimate_memory
from finetune_operator.sizing import constants as K

GIB = 1 << 30
L8 = PRESETS["llama-3.1-8b"]
P8 = 8_030_261_248  # Llama 3.1 8B parameters
# LoRA r=16 on every linear of Llama 3.1 8B: 32 layers x 16 x (sum of in + out) =
# 32 x 16 x ((4096+4096) + 2 x (4096+1024) + (4096+4096) + 3 x (4096+14336)) = 41,943,040
LORA8_R16 = 41_943_040


def setup(**kw):
    kw.setdefault("architecture", L8)
    return TrainingSetup(**kw)


def phase_terms(est: MemoryEstimate):
    return est.breakdown


# ---- static terms, by hand --------------------------------------------------------------


def test_full_single_gpu_optimizer_phase_is_16_bytes_per_param():
    # fp32 weights 4 + fp32 grads 4 + AdamW 8 (fused: no temporaries)
    est = estimate_memory(setup(method="full", gradient_checkpointing=True))
    assert est.phase_peaks["optimizer"] == 16 * P8
    assert est.breakdown["weights"] == 4 * P8


def test_ddp_adds_bucket_copy_of_gradients():
    est = estimate_memory(setup(method="full", strategy="ddp", world_size=4, gradient_checkpointing=True))
    assert est.phase_peaks["optimizer"] == 16 * P8 + 4 * P8


def test_fsdp_shards_weights_grads_and_states():
    est = estimate_memory(setup(method="full", strategy="fsdp", world_size=8, gradient_checkpointing=True))
    assert est.phase_peaks["optimizer"] == round(16 * P8 / 8)


def test_lora_trainable_params_and_static_terms():
    assert L8.lora_trainable_params(16, "all-linear") == LORA8_R16
    est = estimate_memory(setup(method="lora", lora_rank=16))
    # bf16 frozen base + fp32 adapters; fp32 grads and AdamW only for the adapters
    assert est.phase_peaks["optimizer"] == 2 * P8 + 4 * LORA8_R16 + 4 * LORA8_R16 + 8 * LORA8_R16


def test_zero3_bf16_with_fp32_master():
    n = 8
    est = estimate_memory(setup(method="full", strategy="zero3", world_size=n, gradient_checkpointing=True))
    terms = est.breakdown
    assert terms["master_weights"] == round(4 * P8 / n)
    assert terms["optimizer"] == round(8 * P8 / n)
    assert terms["gradients"] == round(2 * P8 / n)  # the bf16 gradient partition, allocated at start-up
    # bf16 partitions, and the 65 RMSNorm weights (4096 elements, under the persistence threshold) whole
    assert terms["weights"] == round(2 * P8 / n + 2 * 65 * 4096)


def test_zero2_keeps_weights_whole_and_shards_the_rest():
    n = 4
    est = estimate_memory(setup(method="full", strategy="zero2", world_size=n, gradient_checkpointing=True))
    opt = est.phase_peaks["optimizer"]
    # overlap_comm's two reduce buckets and the all-gather bucket, as the trainer's DeepSpeed config sets them
    buckets = 2 * 2 * K.ZERO_REDUCE_BUCKET_ELEMENTS  # overlap_comm: two reduce buckets, bf16 (bench/zero_truth.py)
    assert opt == round(2 * P8 + 2 * P8 / n + 4 * P8 / n + 8 * P8 / n + buckets)


def test_zero1_bf16():
    n = 4
    est = estimate_memory(setup(method="full", strategy="zero1", world_size=n, gradient_checkpointing=True))
    buckets = 2 * 2 * K.ZERO_REDUCE_BUCKET_ELEMENTS  # overlap_comm: two reduce buckets, bf16 (bench/zero_truth.py)
    assert est.phase_peaks["optimizer"] == round(2 * P8 + 2 * P8 + 12 * P8 / n + buckets)


def test_8bit_adam_states():
    est = estimate_memory(setup(method="full", optimizer="adamw-8bit", gradient_checkpointing=True))
    # two uint8 states + an fp32 absmax per 256 elements per state, and a 256-entry fp32 code table per
    # state tensor; the embeddings' states stay 32-bit (transformers' Trainer registers them so).
    a = PRESETS["llama-3.1-8b"]
    embedding = a.vocab_size * a.hidden_size
    quantised_tensors = 7 * a.num_layers + 1 + (2 * a.num_layers + 1)  # linears, lm_head, norms (4096 each)
    states = (P8 - embedding) * (2 + 8 / 256) + 2 * 4 * 256 * quantised_tensors + 8 * embedding
    assert est.phase_peaks["optimizer"] == round(8 * P8 + states)


def test_qlora_nf4_weights():
    a = PRESETS["llama-3.1-70b"]
    p = a.total_params
    lin = a.linear_params
    lora = a.lora_trainable_params(16, "all-linear")
    est = estimate_memory(TrainingSetup(architecture=a, method="qlora", lora_rank=16, gradient_checkpointing=True))
    # 4-bit weights + one 8-bit absmax per 64 + one fp32 per 256 absmax blocks (and per weight an
    # offset and two code tables); the rest (embeddings, norms, head) is cast to fp32 by peft's
    # prepare_model_for_kbit_training.
    from finetune_operator.sizing.states import nf4_quant_state_bytes

    state = nf4_quant_state_bytes(a)
    nf4 = 0.5 * lin + state
    expected = nf4 + 4 * (p - lin) + 4 * lora
    assert est.phase_peaks["optimizer"] == round(expected + 4 * lora + 8 * lora)
    assert 0.515 < nf4 / lin < 0.517
    # about 1 GiB at 70B: 80 layers x 7 weights
    per_weight_tables = 512 + 512 + 1024  # offset, NF4 code, absmax code: one 512-byte block or two each
    assert state == pytest.approx(lin / 64 + 4 * lin / (64 * 256) + 80 * 7 * per_weight_tables, rel=1e-4)
    assert 0.95 * GIB < state < 1.1 * GIB


def test_offload_moves_states_to_host():
    base = setup(method="full", strategy="zero3", world_size=8, gradient_checkpointing=True)
    off = setup(method="full", strategy="zero3", world_size=8, gradient_checkpointing=True, offload="optimizer")
    e0, e1 = estimate_memory(base), estimate_memory(off)
    # fp32 master + AdamW + the bf16 gradient partition leave the GPU; the host also holds each
    # sub-group's fp32 gradient buffer (DeepSpeed's offload path, sizing/zero3.py)
    moved = (4 + 8 + 2) * P8 / 8
    # the step's transient: a flattened bf16 copy and the fp32 gradient of one sub-group on the GPU
    # without offload, the fp32 sub-group coming back from the host with it
    from finetune_operator.sizing import zero3

    trace = zero3.decoder_trace(L8, "full", 16, "all-linear", False, True)
    sub, _ = zero3.largest_sub_group(trace, K.ZERO_SETTINGS, 8)
    assert e0.phase_peaks["optimizer"] - e1.phase_peaks["optimizer"] == pytest.approx(moved + 2 * sub, abs=2)
    assert e1.host_required_bytes - e0.host_required_bytes == pytest.approx(moved + 4 * P8 / 8, abs=2)


# ---- activations and logits, by hand ---------------------------------------------------------------


def test_logits_at_the_end_of_forward_are_ten_bytes_per_vocab_entry():
    # bf16 logits (2) + fp32 upcast for the loss (4) + log_softmax output (4) = 10 bytes
    s = setup(method="lora", micro_batch_size=2, sequence_length=4096, gradient_checkpointing=True)
    est = estimate_memory(s)
    tokens = 2 * 4096
    # the forward phase's logits term
    from finetune_operator.sizing.activations import logits_bytes
    from finetune_operator.sizing.regime import regime_of

    fwd, bwd = logits_bytes(L8, s, regime_of(s))
    assert fwd * tokens == 10 * 128256 * tokens
    assert bwd == 12 * 128256
    assert est.breakdown["logits"] in (0, 10 * 128256 * tokens, 12 * 128256 * tokens)


def test_checkpointing_keeps_only_block_inputs():
    b, s = 4, 4096
    tokens = b * s
    gc = estimate_memory(setup(method="lora", micro_batch_size=b, sequence_length=s, gradient_checkpointing=True))
    # the forward keeps one bf16 hidden state per block and token (+ rotary tables, final norm)
    kept = 32 * 2 * 4096 * tokens
    from finetune_operator.sizing.memory import PHASES  # noqa: F401

    no_gc = estimate_memory(setup(method="lora", micro_batch_size=b, sequence_length=s))
    assert gc.peak_allocated_bytes < no_gc.peak_allocated_bytes
    # activations term at forward with checkpointing is dominated by the kept inputs
    assert gc.phase_peaks["forward"] - no_gc.phase_peaks["forward"] < 0
    fwd_static = 2 * P8 + 12 * LORA8_R16 + 2 * LORA8_R16  # weights, states, bf16 adapter copies
    logits = 10 * 128256 * tokens
    rest = gc.phase_peaks["forward"] - fwd_static - logits
    # plus the final norm's fp32 input and bf16 output, the embedding output and the rotary
    # tables: about four more hidden states' worth (8h x tokens, 12% of 32 blocks' inputs here)
    assert kept <= rest <= kept + 8 * 4096 * tokens + 4 * 128 * tokens


def test_eager_keeps_the_score_matrices():
    s = 2048
    sdpa = estimate_memory(setup(method="lora", sequence_length=s))
    eager = estimate_memory(setup(method="lora", sequence_length=s, attention="eager"))
    # softmax output fp32 (4) + its bf16 cast (2) per head and key position, per block
    scores = 32 * 6 * 32 * s * s
    assert eager.peak_allocated_bytes - sdpa.peak_allocated_bytes >= scores


# ---- required bytes, contract -----------------------------------------------------------------------


def test_required_is_peak_times_the_setup_s_required_factor_plus_reserve():
    one = setup(method="lora", world_size=1)
    est = estimate_memory(one)
    assert est.fragmentation_factor == required_factor(one)
    assert est.required_bytes == math.ceil(est.peak_allocated_bytes * required_factor(one)) + K.CUDA_CONTEXT_RESERVE_BYTES
    four = setup(method="lora", world_size=4, gradient_checkpointing=True)
    est4 = estimate_memory(four)
    assert est4.fragmentation_factor == required_factor(four)
    assert est4.required_bytes == (
        math.ceil(est4.peak_allocated_bytes * required_factor(four)) + K.CUDA_CONTEXT_RESERVE_BYTES + K.NCCL_RESERVE_BYTES
    )


@pytest.mark.parametrize("method", ["full", "lora", "qlora"])
@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "zero1", "zero2", "zero3"])
def test_json_contract_and_breakdown_sums_to_peak(method, strategy):
    if method == "qlora" and strategy in ("zero1", "zero2"):
        pytest.skip("qlora runs with ddp, fsdp or zero3")
    est = estimate_memory(setup(method=method, strategy=strategy, world_size=4, gradient_checkpointing=True))
    doc = json.loads(json.dumps(est.to_json()))
    per = doc["perGPU"]
    for key in ("weights", "gradients", "optimizer", "activations", "logits", "buffers"):
        assert isinstance(per["breakdown"][key], int)
    assert sum(per["breakdown"].values()) == per["peakAllocatedBytes"]
    assert per["peakPhase"] in ("forward", "backward", "optimizer")
    assert per["requiredBytes"] > per["peakAllocatedBytes"]
    assert doc["host"]["requiredBytes"] > 0
    assert isinstance(doc["notes"], list)


def test_monotonic_in_batch_sequence_and_ranks():
    def peak(**kw):
        return estimate_memory(setup(**kw)).peak_allocated_bytes

    assert peak(micro_batch_size=1) < peak(micro_batch_size=2) < peak(micro_batch_size=8)
    assert peak(sequence_length=1024) < peak(sequence_length=8192)
    assert peak(method="full", strategy="fsdp", world_size=2) > peak(method="full", strategy="fsdp", world_size=8)


def test_sequence_beyond_context_is_a_note():
    a = PRESETS["phi-3-mini"]
    est = estimate_memory(TrainingSetup(architecture=a, sequence_length=8192))
    assert any("context" in n for n in est.notes)


@pytest.mark.parametrize(
    "kw,field",
    [
        (dict(method="sft"), "method"),
        (dict(strategy="tp"), "strategy"),
        (dict(micro_batch_size=0), "micro_batch_size"),
        (dict(sequence_length=-1), "sequence_length"),
        (dict(world_size=0), "world_size"),
        (dict(offload="optimizer"), "offload"),  # ddp cannot offload
        (dict(method="qlora", strategy="zero2", world_size=2), "strategy"),  # qlora shards with fsdp or zero3 only
        (dict(method="lora", lora_rank=0), "lora_rank"),
        (dict(method="lora", lora_targets=("nope",)), "lora_targets"),
        (dict(method="full", strategy="fsdp", world_size=2, offload="optimizer"), "offload"),
        (dict(method="full", strategy="zero2", world_size=2, optimizer="adamw-8bit"), "optimizer"),
    ],
)
def test_bad_setup_names_the_field(kw, field):
    with pytest.raises(SizingError) as err:
        setup(**kw)
    assert err.value.field == field


def test_estimate_is_fast():
    setups = [setup(method=m, strategy=s, world_size=8, gradient_checkpointing=g)
              for m in ("full", "lora") for s in ("ddp", "fsdp", "zero3") for g in (False, True)]
    for s in setups:
        estimate_memory(s)  # warm caches, as the planner's repeated calls do
    n = 50
    t0 = time.perf_counter()
    for _ in range(n):
        for s in setups:
            estimate_memory(s)
    per_call = (time.perf_counter() - t0) / (n * len(setups))
    assert per_call < 1e-3


def test_no_torch_import():
    import subprocess
    import sys

    code = "import sys, finetune_operator.sizing as s; s.estimate_memory(s.TrainingSetup(architecture=s.PRESETS['llama-3.2-1b'])); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "False"


def test_every_preset_and_valid_combination_estimates_sanely():
    """No combination crashes; every term is non-negative and the breakdown sums to the peak."""
    import itertools

    count = 0
    for preset, method, strategy, offload, gc, attention in itertools.product(
        sorted(PRESETS), ("full", "lora", "qlora"), ("ddp", "fsdp", "zero1", "zero2", "zero3"),
        ("none", "optimizer", "optimizer+params"), (False, True), ("sdpa", "eager"),
    ):
        try:
            s = TrainingSetup(architecture=PRESETS[preset], method=method, strategy=strategy, offload=offload,
                              gradient_checkpointing=gc, attention=attention, world_size=8, micro_batch_size=2,
                              sequence_length=4096)
        except SizingError:
            continue
        est = estimate_memory(s)
        assert all(v >= 0 for v in est.breakdown.values()), (s, est.breakdown)
        assert sum(est.breakdown.values()) == est.peak_allocated_bytes
        assert est.peak_allocated_bytes >= max(est.phase_peaks.values()) - 8
        assert est.host_required_bytes > 0
        count += 1
    assert count > 1000

"""The throughput model: the documented rules hold exactly where they are exact."""

from __future__ import annotations

import pytest

from finetune_operator.planning import load_catalog
from finetune_operator.planning.throughput import (
    CPU_ADAM_PARAMS_PER_CORE_SECOND,
    DEFAULT_NODE_CPUS,
    PCIE_GBYTES,
    QLORA_DEQUANT_TOKENS,
    active_params,
    job_work,
    matmul_params,
    step_seconds,
)
from finetune_operator.sizing import PRESETS

H100, L40S = load_catalog([
    {"name": "h", "region": "r", "gpuType": "H100-80GB", "gpusPerNode": 8, "maxNodes": 4, "interNodeGbps": 400},
    {"name": "l", "region": "r", "gpuType": "L40S-48GB", "gpusPerNode": 4, "maxNodes": 4, "interNodeGbps": 100},
])


def work(method="full", preset="llama-3.1-8b", precision="bf16", seq=4096, batch=64):
    return job_work(PRESETS[preset], method=method, lora_rank=16, lora_targets="all-linear", precision=precision,
                    sequence_length=seq, global_batch_size=batch)


def seconds(w, pool=H100, nodes=1, gpus=1, strategy="ddp", offload="none", ckpt=False, micro=1):
    return step_seconds(w, pool, nodes=nodes, gpus_per_node=gpus, strategy=strategy, offload=offload,
                        gradient_checkpointing=ckpt, micro_batch_size=micro)


def test_full_fine_tuning_is_6n_per_token_plus_attention():
    arch = PRESETS["llama-3.1-8b"]
    w = work()
    attention = 6 * arch.num_layers * 4096 * arch.q_size
    # N leaves out the untied input embedding: a lookup, no matmul (the output head is one).
    n = arch.total_params - arch.vocab_size * arch.hidden_size
    assert w.flops_per_token == pytest.approx(6 * n + attention)


def test_a_tied_embedding_is_the_output_head_and_costs_flops():
    tied = PRESETS["llama-3.2-3b"]
    assert tied.tie_word_embeddings
    assert matmul_params(tied) == tied.total_params
    untied = PRESETS["llama-3.1-8b"]
    assert matmul_params(untied) == untied.total_params - untied.vocab_size * untied.hidden_size


def test_qlora_dequantisation_is_amortised_over_the_micro_batch():
    # Same FLOPs as LoRA; the dequantisation is paid per weight and pass, so per token it shrinks
    # as the micro-batch grows (torchtune: 2% at 2 x 4096 tokens; bench/throughput_published.py).
    lora, qlora = work("lora"), work("qlora")
    assert qlora.flops_per_token == lora.flops_per_token
    for micro in (1, 4):
        tokens = micro * 4096
        assert seconds(qlora, micro=micro) / seconds(lora, micro=micro) == \
            pytest.approx((tokens + QLORA_DEQUANT_TOKENS) / tokens)
    short = work("qlora", seq=512), work("lora", seq=512)
    assert seconds(short[0]) / seconds(short[1]) > seconds(qlora, micro=4) / seconds(lora, micro=4) + 0.3


def test_checkpointing_costs_a_third_more_for_full_and_a_half_more_for_lora():
    assert seconds(work(), ckpt=True) / seconds(work()) == pytest.approx(4 / 3)
    lora = work("lora")
    assert seconds(lora, ckpt=True) / seconds(lora) == pytest.approx(1.5, rel=0.01)


def test_lora_is_about_two_thirds_of_full_and_qlora_pays_for_dequantisation():
    assert seconds(work("lora")) / seconds(work()) == pytest.approx(2 / 3, rel=0.01)
    assert seconds(work("qlora")) > seconds(work("lora"))


def test_moe_counts_only_routed_experts():
    mixtral = PRESETS["mixtral-8x7b"]
    assert active_params(mixtral) < mixtral.total_params / 3
    assert active_params(PRESETS["llama-3.1-8b"]) == PRESETS["llama-3.1-8b"].total_params


def test_larger_micro_batches_are_never_slower():
    w = work()
    for strategy in ("ddp", "fsdp", "zero3"):
        times = [seconds(w, nodes=2, gpus=8, strategy=strategy, micro=m) for m in (1, 2, 4)]
        assert times == sorted(times, reverse=True)


def test_cross_node_and_pcie_traffic_cost_time():
    w = work(batch=16)
    # FSDP all-gathers every micro-step: on PCIe cards over a 100 Gbit/s network it shows.
    one_node = seconds(w, pool=L40S, nodes=1, gpus=4, strategy="fsdp")
    two_nodes = seconds(w, pool=L40S, nodes=2, gpus=2, strategy="fsdp")
    assert two_nodes > one_node
    compute_only = seconds(w, pool=L40S, nodes=1, gpus=1, strategy="fsdp") / 4
    assert one_node > compute_only


def test_offload_costs_the_cpu_step_and_pcie_traffic():
    w = work()  # 8B full: 8.03e9 trainable parameters, 16 GB of bf16 gradients
    base = seconds(w, gpus=8, strategy="zero3", micro=8)
    optimizer = seconds(w, gpus=8, strategy="zero3", offload="optimizer", micro=8)
    # The 8 ranks update their shards on all of the node's cores.
    cpu_step = w.trainable_params / (DEFAULT_NODE_CPUS * CPU_ADAM_PARAMS_PER_CORE_SECOND)
    assert optimizer == pytest.approx(base + cpu_step, rel=0.05) and optimizer >= base + cpu_step
    assert optimizer <= base + cpu_step + 2 * w.grad_bytes / 8 / (PCIE_GBYTES * 1e9)
    # Streaming the weights every micro-step: more micro-steps, more traffic.
    assert seconds(w, gpus=8, strategy="zero3", offload="optimizer+params", micro=1) > \
        seconds(w, gpus=8, strategy="zero3", offload="optimizer+params", micro=8) >= optimizer


def test_offloading_70b_to_one_gpu_is_slow():
    w = work(preset="llama-3.1-70b", batch=256)
    one = seconds(w, gpus=1, strategy="fsdp", offload="optimizer+params", ckpt=True, micro=4)
    eight = seconds(w, gpus=8, strategy="fsdp", offload="optimizer+params", ckpt=True, micro=4)
    # 64 micro-steps each stream 3 x 141 GB of weights over one PCIe link.
    assert one > 64 * 3 * w.weight_bytes / (PCIE_GBYTES * 1e9)
    assert one * 1 > eight * 8


def test_fp32_runs_at_half_rate():
    assert seconds(work(precision="fp32")) == pytest.approx(2 * seconds(work()), rel=0.01)


def test_spreading_over_nodes_buys_no_bandwidth_or_cores():
    w = work(batch=64)
    packed = seconds(w, nodes=1, gpus=2, strategy="fsdp", offload="optimizer+params", micro=4)
    spread = seconds(w, nodes=2, gpus=1, strategy="fsdp", offload="optimizer+params", micro=4)
    assert spread >= packed

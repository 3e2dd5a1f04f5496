"""training.sequenceParallel (issue 28, context parallelism): the sizing term, the refusals, the planner's
last resort and the numbers that follow from a split (accumulation, data-parallel size, step time, the
evaluation). The trainer running it: tests/trainer/test_trainer_sequence_parallel.py; the term against
real DeepSpeed on the CPU: bench/sequence_parallel_truth.py."""

from __future__ import annotations

from dataclasses import replace

import pytest

from finetune_operator import api
from finetune_operator.planning import Infeasible, plan_job
from finetune_operator.planning.search.ask import ask_from_spec
from finetune_operator.planning.search.estimate import Estimates
from finetune_operator.planning.throughput import compute_and_communication, job_work
from finetune_operator.sizing import SizingError, TrainingSetup, estimate_memory
from finetune_operator.sizing.presets import preset

from .test_search import POLICY, pool, spec

L8 = preset("llama-3.1-8b")


def setup(**changes) -> TrainingSetup:
    base = dict(architecture=L8, method="lora", lora_rank=16, strategy="zero3", world_size=8, micro_batch_size=1,
                sequence_length=32768, gradient_checkpointing=True, attention="flash")
    base.update(changes)
    return TrainingSetup(**base)


def test_a_gpu_of_a_split_sequence_holds_what_an_unsplit_run_of_its_slice_holds_and_the_exchange():
    for ckpt in (True, False):
        split = estimate_memory(setup(sequence_parallel=4, gradient_checkpointing=ckpt)).breakdown
        slice_ = estimate_memory(setup(sequence_length=8192, gradient_checkpointing=ckpt)).breakdown
        # Saved activations and logits per GPU: those of the slice (Llama 3.1 8B has 8 key/value heads,
        # so 4 GPUs need no repeated heads), and without checkpointing the one output-sized tensor per
        # block Ulysses keeps more (32 blocks x 4096 x 8192 tokens x 2 bytes; measured on the CPU).
        extra = 0 if ckpt else 32 * 4096 * 8192 * 2
        assert split["activations"] == slice_["activations"] + extra and split["logits"] == slice_["logits"]
        assert split["weights"] == slice_["weights"] and split["optimizer"] == slice_["optimizer"]
    whole = estimate_memory(setup()).peak_allocated_bytes
    assert estimate_memory(setup(sequence_parallel=4)).peak_allocated_bytes < whole / 2
    # A row is padded to a multiple of the degree (the collator's padding), then split.
    odd = setup(sequence_length=32767, sequence_parallel=4)
    assert (odd.row_length, odd.sequence_shard, odd.tokens_per_micro_batch) == (32768, 8192, 8192)


def test_more_gpus_than_key_value_heads_repeat_them():
    few = replace(L8, num_key_value_heads=2)
    repeated = estimate_memory(setup(architecture=few, sequence_parallel=8, gradient_checkpointing=False))
    plain = estimate_memory(setup(architecture=few, sequence_length=4096, gradient_checkpointing=False))
    # Each GPU holds one key and one value head over the whole sequence: 8 x 128 wide per token of its
    # slice, not 2 x 128 (two k/v-sized tensors in each of 32 blocks, bf16); and the output-sized tensor
    # per block Ulysses keeps (4096 wide).
    extra = 2 * 2 * (8 - 2) * 128 * 4096 * 32 + 2 * 4096 * 4096 * 32
    assert repeated.breakdown["activations"] - plain.breakdown["activations"] == extra


@pytest.mark.parametrize("changes, words", [
    ({"sequence_parallel": 3}, "3 does not divide them"),
    ({"architecture": replace(L8, num_key_value_heads=6, num_attention_heads=24, head_dim=128),
      "sequence_parallel": 4}, "must divide one another"),
    ({"attention": "eager", "sequence_parallel": 2}, "eager attention"),
    ({"attention": "sdpa", "padding_free": True, "sequence_parallel": 2}, "needs flash attention"),
    ({"architecture": preset("gemma-2-9b"), "attention": "sdpa", "sequence_parallel": 2}, "sliding-window"),
    ({"strategy": "fsdp", "sequence_parallel": 2}, "zero1, zero2 or zero3"),
])
def test_what_the_split_cannot_run_is_a_sizing_error_naming_it(changes, words):
    with pytest.raises(SizingError) as error:
        estimate_memory(setup(**changes))
    assert error.value.field in ("sequence_parallel", "sequence_split")
    assert words in error.value.message, error.value.message


def job(**changes):
    base = {"model.architecture": {"preset": "llama-3.1-8b"}, "training.sequenceLength": 262144,
            "training.globalBatchSize": 8, "training.attention": "flash"}
    base.update(changes)
    return spec(**base)


def test_the_planner_splits_a_sequence_only_when_nothing_fits_without_it():
    pools = [pool("h100")]
    long = plan_job(job(), pools, POLICY)
    assert not isinstance(long, Infeasible), long
    # 256k tokens of an 8B LoRA fit no GPU whole (even offloaded and checkpointed): split over 4, with
    # the chunked loss on each GPU's slice (auto: 8 chunks).
    assert long.sequence_parallel == 4 and long.strategy.startswith("zero") and long.loss_chunks == 8
    assert long.data_parallel_size == long.gpus // 4
    assert long.gradient_accumulation == 8 * 4 // (long.micro_batch_size * long.gpus)
    assert "sequence split over 4 GPUs" in long.reason and "sequence parallelism" in long.changes
    assert isinstance(plan_job(job(**{"training.sequenceParallel": 1}), pools, POLICY), Infeasible)
    # What fits whole is never split, though the split would lower its memory.
    short = plan_job(job(**{"training.sequenceLength": 8192}), pools, POLICY)
    assert short.sequence_parallel == 1
    # A degree the job names is planned as named, on a multiple of it.
    named = plan_job(job(**{"training.sequenceLength": 8192, "training.sequenceParallel": 2}), pools, POLICY)
    assert named.sequence_parallel == 2 and named.gpus % 2 == 0


def test_evaluation_of_a_split_plan_is_sized_whole():
    """The trainer evaluates each rank's sequences whole (one at a time unless the job names its eval
    micro-batch): a 256k sequence whole fits no GPU, so the job cannot be planned, and says why."""
    result = plan_job(job(evaluation={"heldOutFraction": 0.05}), [pool("h100")], POLICY)
    assert isinstance(result, Infeasible)
    assert "setups were left out because their evaluation does not fit" in result.message, result.message
    ask = ask_from_spec(job(**{"training.sequenceLength": 32768}, evaluation={"heldOutFraction": 0.05}),
                        POLICY, None)
    estimates = Estimates(ask, estimate_memory)
    levers = plan_job(job(**{"training.sequenceLength": 32768, "training.sequenceParallel": 4}), [pool("h100")],
                      POLICY)
    assert levers.sequence_parallel == 4
    from finetune_trainer.memory_levers import levers_of

    split = levers_of(levers)
    whole = estimates.eval_required(8, "zero3", "none", split, 1)
    assert whole == estimates.eval_required(8, "zero3", "none", split._replace(sequence_parallel=1), 1)


def test_the_exchange_costs_step_time():
    work = job_work(L8, method="lora", lora_rank=16, lora_targets="all-linear", precision="bf16",
                    sequence_length=65536, global_batch_size=8)
    h100 = pool("h100")
    kw = dict(nodes=1, gpus_per_node=8, strategy="zero3", gradient_checkpointing=True, micro_batch_size=1)
    compute, communication = compute_and_communication(work, h100, **kw)
    split_compute, split_communication = compute_and_communication(work, h100, **kw, sequence_parallel=8)
    # The same tokens per GPU in smaller pieces (less efficient), and every block's q, k, v and output
    # exchanged three times (forward, recompute, backward) on top of ZeRO-3's gathers, 8 times as often.
    assert split_compute > compute and split_communication > 8 * communication


@pytest.mark.parametrize("changes, words", [
    ({"training.sequenceParallel": 2, "training.attention": "eager"}, "eager attention"),
    ({"training.sequenceParallel": 2, "training.attention": "sdpa", "dataset.packing": True}, "needs flash"),
    ({"training.sequenceParallel": 4, "resources.gpus": 6}, "do not divide gpus 6"),
    ({"training.sequenceParallel": 2, "resources.strategy": "ddp"}, "zero1, zero2 or zero3"),
    ({"training.sequenceParallel": 2, "method": "qlora"}, "use method lora or full"),
])
def test_the_api_refuses_what_the_split_cannot_run_naming_the_field(changes, words):
    with pytest.raises(ValueError) as error:
        job(**changes)
    assert "training.sequenceParallel" in str(error.value)
    assert words in str(error.value)

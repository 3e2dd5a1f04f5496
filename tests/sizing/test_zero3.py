"""DeepSpeed ZeRO-3 per rank (sizing/zero3.py): the replay's rules on small traces, its properties
on real models, and the settings the trainer writes being the ones the sizing reads."""

from dataclasses import replace

import pytest
from hypothesis import given, settings, strategies as st

from finetune_operator.rendering.strategy import BatchSettings, build_deepspeed_config
from finetune_operator.sizing import PRESETS, ModelArchitecture, TrainingSetup, estimate_memory
from finetune_operator.sizing import constants as K
from finetune_operator.sizing import zero3
from finetune_operator.sizing.zero3 import ModuleTrace, Param, largest_sub_group, rank_memory, replay
from finetune_trainer.contract import ZERO_SETTINGS, ZeroSettings, deepspeed_config

GIB = 1 << 30
# Llama 2 7B (the published full ZeRO-3 runs on 2 x 80 GB): 32k vocabulary, no GQA.
LLAMA2_7B = ModelArchitecture.from_hf_config({
    "model_type": "llama", "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
    "max_position_embeddings": 4096})


def chain(*numels: int) -> ModuleTrace:
    """A stack of one-parameter modules under a container: forward in order, backward reversed."""
    params = tuple(Param(n) for n in numels)
    modules = ((),) + tuple((i,) for i in range(len(numels)))
    forward = tuple(range(len(modules)))
    backward = (0,) + tuple(range(len(modules) - 1, 0, -1))
    return ModuleTrace(params, modules, forward, backward)


def small(**kw) -> ZeroSettings:
    base = dict(reduce_bucket_size=1000, allgather_bucket_size=1000, prefetch_bucket_size=100,
                param_persistence_threshold=10, max_live_parameters=10_000, max_reuse_distance=1)
    base.update(kw)
    return ZeroSettings(**base)


# ---- the replay's rules, by hand ------------------------------------------------------------------


def test_without_prefetch_one_module_is_gathered_at_a_time():
    # prefetch bucket 1 element: nothing but the running module (fetch prefetches at least one
    # parameter only when the bucket has room: 1 > 0 numel, so the next one comes along).
    trace = chain(100, 100, 100, 100)
    r = replay(trace, small(prefetch_bucket_size=1), world=2)
    # the running module and the one prefetched beside it
    assert r.forward == 200


def test_prefetch_gathers_ahead_up_to_the_bucket_and_the_live_limit():
    trace = chain(*([100] * 10))
    wide = replay(trace, small(prefetch_bucket_size=300), world=2)
    narrow = replay(trace, small(prefetch_bucket_size=100), world=2)
    capped = replay(trace, small(prefetch_bucket_size=300, max_live_parameters=200), world=2)
    assert narrow.forward < wide.forward
    assert capped.forward < wide.forward


def test_persistent_parameters_are_never_gathered():
    trace = chain(5, 5, 5)  # under the threshold of 10
    assert replay(trace, small(), world=2).forward == 0
    memory = rank_memory(trace, world=2, compute_bytes=2, optimizer_bytes_per_param=8, settings=small())
    assert memory.persistent == 2 * 15


def test_reuse_distance_keeps_the_last_modules_for_backward():
    trace = chain(100, 100, 100)
    # Reuse distance 1: only the last module stays (its backward is next, nothing between), and
    # the prefetch has walked on into the backward's queue: the module after it is gathered too.
    assert replay(trace, small(prefetch_bucket_size=1), world=1).end_of_forward == 200
    # A long reuse distance keeps every module the backward uses again within it.
    kept = replay(trace, small(prefetch_bucket_size=1, max_reuse_distance=10_000), world=1)
    assert kept.end_of_forward == 300


def test_a_gradient_larger_than_the_bucket_stays_until_the_next_reduce():
    trace = chain(100, 5000, 100)  # 5000 > reduce bucket of 1000
    r = replay(trace, small(prefetch_bucket_size=1), world=2)
    # backward of the 5000 module: its gathered weight, its gradient, the next module prefetched
    assert r.backward >= 5000 + 5000


def test_sub_groups_close_at_the_parameter_that_reaches_the_size():
    trace = chain(400, 400, 400, 400)
    # partitions of 200 per rank at world 2; sub-groups of >= 300: [200, 200], [200, 200]
    assert largest_sub_group(trace, small(sub_group_size=300), world=2) == (400, 2)
    assert largest_sub_group(trace, small(sub_group_size=10_000), world=2) == (800, 4)


def test_offload_moves_master_states_and_gradients_to_the_host():
    trace = chain(*([10_000] * 8))
    on = rank_memory(trace, world=4, compute_bytes=2, optimizer_bytes_per_param=8, settings=small())
    off = rank_memory(trace, world=4, compute_bytes=2, optimizer_bytes_per_param=8, offload="optimizer",
                      settings=small())
    part = 8 * 10_000 / 4
    assert (on.master, on.optimizer, on.gradients) == (4 * part, 8 * part, 2 * part)
    assert (off.master, off.optimizer, off.gradients) == (0, 0, 0)
    assert off.host == (4 + 8 + 2 + 4) * part  # with each sub-group's fp32 gradient buffer
    both = rank_memory(trace, world=4, compute_bytes=2, optimizer_bytes_per_param=8, offload="optimizer+params",
                       settings=small())
    assert both.weights == 0 and both.host == off.host + 2 * part


def test_bad_settings_name_the_field():
    with pytest.raises(ValueError, match="ZeroSettings.sub_group_size"):
        ZeroSettings(sub_group_size=0)


# ---- properties on real models --------------------------------------------------------------------


def full_zero3(arch, world, **kw):
    kw.setdefault("gradient_checkpointing", True)
    return TrainingSetup(architecture=arch, method="full", strategy="zero3", world_size=world, **kw)


@pytest.mark.parametrize("preset", ["llama-3.1-8b", "llama-3.1-70b", "qwen2.5-7b", "gemma-2-9b", "qwen3-30b-a3b"])
@pytest.mark.parametrize("method", ["full", "lora"])
def test_per_rank_memory_decreases_with_the_world_size(preset, method):
    arch = PRESETS[preset]
    peaks = [estimate_memory(TrainingSetup(architecture=arch, method=method, strategy="zero3", world_size=w,
                                           gradient_checkpointing=True)).peak_allocated_bytes
             for w in (1, 2, 4, 8, 16)]
    assert all(a > b for a, b in zip(peaks, peaks[1:])), peaks


@settings(max_examples=25, deadline=None)
@given(layers=st.integers(1, 6), world=st.sampled_from([1, 2, 4, 8]),
       buckets=st.lists(st.integers(1, 400_000_000), min_size=2, max_size=2), checkpointing=st.booleans())
def test_no_prefetch_bucket_gives_less_than_the_smallest_one(layers, world, buckets, checkpointing):
    # Not monotonic in the bucket's size, as DeepSpeed's coordinator is not: the size decides where a
    # coalesced prefetch ends, and a batch's flat buffer lives until its last member is waited for, so
    # a larger bucket can end a batch where less is live (one layer of Llama 3.1 8B, one rank: a bucket
    # of 100663297 elements peaks at 1767 MiB in forward, one of 159383553 at 1418 MiB). What holds is
    # that prefetching more than DeepSpeed's least (one parameter ahead) never lowers a peak.
    arch = PRESETS["llama-3.1-8b"].with_layers(layers)
    trace = zero3.decoder_trace(arch, "full", 16, "all-linear", False, checkpointing)
    least = replay(trace, replace(ZERO_SETTINGS, prefetch_bucket_size=1), world)
    for bucket in buckets:
        more = replay(trace, replace(ZERO_SETTINGS, prefetch_bucket_size=bucket), world)
        assert more.forward >= least.forward and more.backward >= least.backward, bucket


def test_llama2_7b_full_zero3_on_two_80gb_gpus_fits():
    # Published: full fine-tuning of Llama 2 7B with ZeRO-3 over 2 x 80 GB runs (the old
    # 12-bytes-per-parameter constant put it above 100 GiB per GPU).
    est = estimate_memory(full_zero3(LLAMA2_7B, 2, sequence_length=2048))
    assert est.required_bytes < 80e9
    # the rank's model states alone are 16 bytes per parameter over two ranks
    assert est.peak_allocated_bytes > 16 * LLAMA2_7B.total_params / 2


def test_the_estimate_counts_the_replayed_terms():
    setup = full_zero3(PRESETS["llama-3.1-8b"], 8)
    est = estimate_memory(setup)
    trace = zero3.decoder_trace(setup.architecture, "full", 16, "all-linear", False, True)
    m = rank_memory(trace, world=8, compute_bytes=2, optimizer_bytes_per_param=8)
    assert est.breakdown["master_weights"] == round(m.master)
    assert est.breakdown["gradients"] == round(m.gradients)  # the partition, in every phase
    fwd = est.phase_peaks["forward"]
    assert fwd >= m.weights + m.persistent + m.master + m.optimizer + m.gradients + m.reduce_bucket + m.gathered_forward


# ---- one place for the settings ---------------------------------------------------------------------


DS_KEYS = {  # DeepSpeed config key -> ZeroSettings field
    "reduce_bucket_size": "reduce_bucket_size",
    "allgather_bucket_size": "allgather_bucket_size",
    "stage3_prefetch_bucket_size": "prefetch_bucket_size",
    "stage3_param_persistence_threshold": "param_persistence_threshold",
    "stage3_max_live_parameters": "max_live_parameters",
    "stage3_max_reuse_distance": "max_reuse_distance",
    "sub_group_size": "sub_group_size",
}


@pytest.mark.parametrize("offload", ["none", "optimizer", "optimizer+params"])
def test_the_settings_the_trainer_writes_are_the_ones_the_sizing_reads(offload):
    written = deepspeed_config(3, offload)["zero_optimization"]
    rendered = build_deepspeed_config("zero3", offload, BatchSettings(
        micro_batch_size=1, gradient_accumulation=1, data_parallel_size=2, precision="bf16", optimizer="adamw",
        learning_rate=1e-4, weight_decay=0.0, max_grad_norm=1.0))["zero_optimization"]
    for config in (written, rendered):
        for key, name in DS_KEYS.items():
            assert config[key] == getattr(K.ZERO_SETTINGS, name), key
    assert K.ZERO_SETTINGS is ZERO_SETTINGS


def test_deepspeed_reads_the_written_settings_as_the_sizing_does():
    ds_config = pytest.importorskip("deepspeed.runtime.zero.config")
    parsed = ds_config.DeepSpeedZeroConfig(**deepspeed_config(3)["zero_optimization"])
    assert parsed.reduce_bucket_size == ZERO_SETTINGS.reduce_bucket_size
    assert parsed.prefetch_bucket_size == ZERO_SETTINGS.prefetch_bucket_size
    assert parsed.param_persistence_threshold == ZERO_SETTINGS.param_persistence_threshold
    assert parsed.max_live_parameters == ZERO_SETTINGS.max_live_parameters
    assert parsed.max_reuse_distance == ZERO_SETTINGS.max_reuse_distance
    assert parsed.sub_group_size == ZERO_SETTINGS.sub_group_size


# ---- against DeepSpeed's own code ------------------------------------------------------------------


@pytest.mark.slow
def test_the_replay_matches_deepspeed_on_the_cpu():
    # bench/zero_truth.py at a small size: two gloo ranks run DeepSpeed's ZeRO-3 with the trainer's
    # config (its budgets divided by 256) and count every allocation; the estimate per phase.
    pytest.importorskip("deepspeed")
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "bench" / "zero_truth.py"
    spec = importlib.util.spec_from_file_location("zero_truth", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    measured = bench.run(3, 2, 512, 6, 256, 29650)
    predicted = bench.estimate(3, 2, 512, 6, 256)
    for phase in bench.PHASES:
        assert predicted[phase] == pytest.approx(measured[phase], rel=0.01), phase

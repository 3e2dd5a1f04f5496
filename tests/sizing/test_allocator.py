"""The caching-allocator model on hand-worked traces: each expected figure is worked out in
the comment beside it from the rules in sizing/allocator.py's docstring."""

import pytest

from finetune_operator.sizing.allocator import (
    MIB,
    OutOfMemory,
    min_capacity,
    replay,
    round_size,
    segment_size,
)


def test_rounding_and_segment_sizes():
    assert round_size(1) == 512 and round_size(512) == 512 and round_size(513) == 1024
    assert segment_size(512) == 2 * MIB  # small pool
    assert segment_size(1 * MIB) == 2 * MIB  # 1 MiB is still small
    assert segment_size(1 * MIB + 512) == 20 * MIB  # 1-10 MiB: a 20 MiB segment
    assert segment_size(10 * MIB - 512) == 20 * MIB
    assert segment_size(10 * MIB) == 10 * MIB  # from 10 MiB: rounded up to 2 MiB
    assert segment_size(10 * MIB + 1) == 12 * MIB


def test_freed_30_mib_block_reused_by_20_mib_request_classic():
    # 30 MiB: a 30 MiB segment. Freed, then 20 MiB: best fit is that block; the rest (10 MiB)
    # is > 1 MiB so it is split off and a 10 MiB request fits it: nothing new is reserved.
    events = [(1, 30 * MIB), (1, None), (2, 20 * MIB), (3, 10 * MIB)]
    s = replay(events, expandable=False)
    assert s.peak_reserved == 30 * MIB
    assert s.peak_allocated == 30 * MIB and s.segments == 1


def test_freed_30_mib_block_reused_by_20_mib_request_expandable():
    # Expandable: 30 MiB maps two 20 MiB pages (40 MiB), the 10 MiB rest is free. Freed, the
    # block merges back to 40 MiB; 20 MiB takes half of it, 10 MiB a part of the other half.
    events = [(1, 30 * MIB), (1, None), (2, 20 * MIB), (3, 10 * MIB)]
    s = replay(events, expandable=True)
    assert s.peak_reserved == 40 * MIB
    assert s.peak_allocated == 30 * MIB


def test_small_pool_packs_into_2_mib_segments():
    # 512 KiB requests: four fill one 2 MiB segment (each split leaves >= 512 B), the fifth opens a second.
    events = [(i, 512 * 1024) for i in range(5)]
    assert replay(events, expandable=False).peak_reserved == 4 * MIB
    # 100-byte requests take 512 B each: 4096 of them fill one segment exactly.
    events = [(i, 100) for i in range(4096)]
    s = replay(events, expandable=False)
    assert s.peak_reserved == 2 * MIB and s.peak_allocated == 2 * MIB


def test_small_and_large_pools_do_not_share():
    # A free 20 MiB large segment cannot serve a 4 KiB request: the small pool opens its own.
    events = [(1, 5 * MIB), (1, None), (2, 4096)]
    assert replay(events, expandable=False).peak_reserved == 22 * MIB


def test_large_pool_split_rule():
    # Two 5 MiB requests share one 20 MiB segment (the 15 MiB rest is > 1 MiB, split off).
    assert replay([(1, 5 * MIB), (2, 5 * MIB)], expandable=False).peak_reserved == 20 * MIB
    # 11 MiB: a 12 MiB segment whose 1 MiB rest is not > 1 MiB: the whole block is handed out
    # (allocated counts 12 MiB), and a 1.5 MiB request needs a segment of its own (20 MiB).
    s = replay([(1, 11 * MIB), (2, 3 * MIB // 2)], expandable=False)
    assert s.peak_allocated == 12 * MIB + 3 * MIB // 2
    assert s.peak_requested == 11 * MIB + 3 * MIB // 2
    assert s.peak_reserved == 32 * MIB
    # 10.5 MiB: a 12 MiB segment, the 1.5 MiB rest is split off and serves a 1.25 MiB request.
    s = replay([(1, 21 * MIB // 2), (2, 5 * MIB // 4)], expandable=False)
    assert s.peak_reserved == 12 * MIB


def test_free_blocks_merge_within_a_segment():
    # Three 5 MiB blocks in one 20 MiB segment; freeing the first two merges them into 10 MiB,
    # which a 9 MiB request fits: still one segment.
    events = [(1, 5 * MIB), (2, 5 * MIB), (3, 5 * MIB), (1, None), (2, None), (4, 9 * MIB)]
    s = replay(events, expandable=False)
    assert s.peak_reserved == 20 * MIB and s.segments == 1


def growing(sizes_mib):
    """Each step allocates the next (larger) buffer, then frees the one before: a sequence of
    growing activations, as variable-length batches give."""
    events = []
    for i, size in enumerate(sizes_mib):
        events.append((i, size * MIB))
        if i:
            events.append((i - 1, None))
    return events


def test_growing_sizes_fragment_classic_not_expandable():
    sizes = [12, 14, 16, 18, 20, 22, 24, 26]
    # Classic: every freed segment is smaller than the next request and segments never merge:
    # each request opens a segment of its own, the reserved figure is the sum.
    classic = replay(growing(sizes), expandable=False)
    assert classic.peak_reserved == sum(sizes) * MIB
    # Expandable, first four steps by hand (20 MiB pages, one segment):
    #   12 -> map 1 page [12 live | 8 free]                                         reserved 20
    #   14 -> 8 free + 1 more page = 28 free -> [12 | 14 live | 14 free]             reserved 40
    #   free 12; 16 -> no free block fits (12, 14) -> tail 14 + 1 page -> [12 f | 14 | 16 | 18 f]  60
    #   free 14 -> 26 free at the front; 18 fits it (best fit skips the growable tail)       60
    assert replay(growing(sizes[:4]), expandable=True).peak_reserved == 60 * MIB
    expandable = replay(growing(sizes), expandable=True)
    # Freed neighbours merge into one range, so two live buffers and page rounding bound it.
    assert expandable.peak_reserved <= (sizes[-1] + sizes[-2]) * MIB + 2 * 20 * MIB
    assert expandable.peak_reserved < classic.peak_reserved / 2


def test_capacity_releases_cached_segments_classic():
    # A 30 MiB segment cached, then 40 MiB under a 50 MiB limit: the free segment is cudaFree'd
    # and the retry fits. Unlimited, both stay reserved (70 MiB).
    events = [(1, 30 * MIB), (1, None), (2, 40 * MIB)]
    assert replay(events, expandable=False).peak_reserved == 70 * MIB
    s = replay(events, expandable=False, capacity=50 * MIB)
    assert s.peak_reserved == 40 * MIB and s.releases == 1
    with pytest.raises(OutOfMemory):
        replay([(1, 30 * MIB), (2, 40 * MIB)], expandable=False, capacity=50 * MIB)


def test_capacity_unmaps_free_pages_expandable():
    # [A 40 | B 20] then A freed: a 40 MiB hole below B. C (60 MiB) fits no free block and maps
    # 3 pages after B: 120 MiB, over an 80 MiB limit; the hole's 2 pages are unmapped, then C fits.
    events = [(1, 40 * MIB), (2, 20 * MIB), (1, None), (3, 60 * MIB)]
    assert replay(events, expandable=True).peak_reserved == 120 * MIB
    s = replay(events, expandable=True, capacity=80 * MIB)
    assert s.peak_reserved == 80 * MIB and s.releases == 1


def test_max_split_size_keeps_oversize_blocks_whole():
    # max_split_size 100 MiB: a cached 200 MiB block is not handed to a 50 MiB request.
    events = [(1, 200 * MIB), (1, None), (2, 50 * MIB)]
    assert replay(events, expandable=False).peak_reserved == 200 * MIB
    assert replay(events, expandable=False, max_split_size=100 * MIB).peak_reserved == 250 * MIB
    # A 150 MiB request may take it only if < 20 MiB is wasted: 200 - 150 >= 20, so no.
    events = [(1, 200 * MIB), (1, None), (2, 150 * MIB)]
    assert replay(events, expandable=False, max_split_size=100 * MIB).peak_reserved == 350 * MIB
    events = [(1, 200 * MIB), (1, None), (2, 190 * MIB)]
    assert replay(events, expandable=False, max_split_size=100 * MIB).peak_reserved == 200 * MIB


def test_min_capacity_is_between_live_peak_and_unlimited_reserved():
    events = growing([12, 14, 16, 18, 20, 22, 24, 26])
    need = min_capacity(events, expandable=False, resolution=2 * MIB)
    # The last two buffers (24 + 26) must be live together in segments of their own.
    assert 50 * MIB <= need <= 52 * MIB
    assert need < replay(events, expandable=False).peak_reserved


def test_zero_byte_and_unknown_frees_are_ignored():
    s = replay([(1, 0), (1, None), (7, None)], expandable=False)
    assert s.peak_reserved == 0 and s.peak_allocated == 0


def test_tracker_records_the_trace_it_counts():
    torch = pytest.importorskip("torch")
    from torch._subclasses.fake_tensor import FakeTensorMode

    from finetune_trainer.peak_tracker import PeakTracker

    with FakeTensorMode(), PeakTracker() as off:
        torch.empty(1000)
    assert off.events is None  # off by default: nothing is recorded

    with FakeTensorMode(), PeakTracker(record=True) as tracker:
        a = torch.empty(1000, dtype=torch.float32)  # 4000 B -> 4096
        b = torch.empty(10, dtype=torch.bfloat16)  # 20 B -> 512
        del b
        a.untyped_storage().resize_(8000)  # a new 8192 B buffer, then the old one freed
        a.untyped_storage().resize_(0)  # freed
        c = torch.empty(256, dtype=torch.float32)  # 1024
        del a, c
    assert tracker.events == [(0, 4096), (1, 512), (1, None), (2, 8192), (0, None), (2, None),
                              (3, 1024), (3, None)]
    # Replayed, the trace's live peak holds both buffers of the resize (as the copy does); the
    # tracker's own count moves by the difference only. FSDP2 resizes to and from 0 only.
    assert replay(tracker.events, expandable=False).peak_requested == 4096 + 8192
    assert tracker.peak == 8192
    # Without the resize, the replayed live peak is the tracker's peak.
    with FakeTensorMode(), PeakTracker(record=True) as tracker:
        x = [torch.empty(n) for n in (100, 5000, 300_000)]
        del x[1]
        x.append(torch.empty(1 << 20))
        del x
    assert replay(tracker.events, expandable=True).peak_requested == tracker.peak


def test_measured_factors_are_the_fit_of_the_stored_replays():
    import json
    import os
    import sys

    from finetune_operator.sizing.allocator import MIN_CAPACITY_FACTORS, TRANSIENT_FACTORS, fit_factors

    bench = os.path.join(os.path.dirname(__file__), "..", "..", "bench")
    sys.path.insert(0, os.path.abspath(bench))
    from allocator_replay import RESULTS, factor_rows

    with open(RESULTS) as f:
        rows = json.load(f)["rows"]
    assert fit_factors((k, v) for k, v, _, _ in factor_rows(rows, held_out=False)) == TRANSIENT_FACTORS
    assert fit_factors((k, v) for k, v, _, _ in factor_rows(rows, held_out=False, measure="min_cap")) \
        == MIN_CAPACITY_FACTORS
    assert any(r["case"]["held_out"] for r in rows) and any(not r["case"]["held_out"] for r in rows)


def test_reserved_bytes_keep_the_resident_part_and_scale_the_transient_rest():
    from finetune_operator.sizing import TrainingSetup, estimate_memory
    from finetune_operator.sizing.allocator import FactorKey, TRANSIENT_FACTORS, reserved_bytes, resident_bytes
    from finetune_operator.sizing.presets import preset

    plain = TrainingSetup(architecture=preset("llama-3.1-8b"), micro_batch_size=2, sequence_length=512)
    gc = TrainingSetup(architecture=preset("llama-3.1-8b"), micro_batch_size=2, sequence_length=512,
                       gradient_checkpointing=True)
    for setup, key in ((plain, FactorKey(True, False, False)), (gc, FactorKey(True, False, True))):
        e = estimate_memory(setup)
        resident = resident_bytes(e)
        assert 0 < resident < e.peak_allocated_bytes
        assert reserved_bytes(e, setup) == resident + (e.peak_allocated_bytes - resident) * TRANSIENT_FACTORS[key]
    # A LoRA run on short padded data is mostly its frozen weights, which do not fragment: its reserved
    # peak stays near its allocated one even with the classic allocator and lengths that vary.
    e = estimate_memory(gc)
    classic = reserved_bytes(e, gc, expandable_segments=False, variable_lengths=True)
    assert e.peak_allocated_bytes < classic < 1.25 * e.peak_allocated_bytes
    # Expandable segments: lengths do not matter; classic: varying lengths cost more.
    assert reserved_bytes(e, gc, variable_lengths=False) == reserved_bytes(e, gc, variable_lengths=True)
    assert classic > reserved_bytes(e, gc, expandable_segments=False, variable_lengths=False)
    # CPU offload is not traced: the mode's largest factor.
    resident = resident_bytes(e)
    assert reserved_bytes(e, plain, cpu_offload=True) == resident + (e.peak_allocated_bytes - resident) * max(
        v for k, v in TRANSIENT_FACTORS.items() if k.expandable)


def test_the_planner_plans_on_the_least_capacity_not_the_unlimited_peak():
    """required_factor: the least capacity the traces ran in (min_capacity), below the unlimited
    reserved peak of the same setups, and never below the live peak."""
    from finetune_operator.sizing import TrainingSetup, estimate_memory
    from finetune_operator.sizing.allocator import (FACTOR_MARGIN, MIN_CAPACITY_FACTORS, FactorKey,
                                                   required_factor, reserved_bytes)
    from finetune_operator.sizing.presets import preset

    for gc in (False, True):
        s = TrainingSetup(architecture=preset("llama-3.2-1b"), gradient_checkpointing=gc)
        fit = MIN_CAPACITY_FACTORS[FactorKey(True, False, gc)]
        assert required_factor(s) == fit + FACTOR_MARGIN >= 1.0 + FACTOR_MARGIN
        e = estimate_memory(s)
        assert e.peak_allocated_bytes <= fit * e.peak_allocated_bytes <= reserved_bytes(e, s)

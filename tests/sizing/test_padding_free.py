"""spec.dataset.paddingFree and spec.dataset.microBatchTokens in the memory model: the micro-batch's
shape (TrainingSetup.rows x row_length) follows the declared tokens, and a padding-free micro-batch
is sized as the one row of real tokens the collator makes (its traced truth:
test_architecture_tracker.py's padding-free and declared cases, bench/sizing_accuracy.py --only free)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from finetune_operator.sizing import SizingError, TrainingSetup, estimate_memory
from finetune_operator.sizing.presets import preset
from finetune_trainer.data import window_tokens

L8 = preset("llama-3.1-8b")


def setup(**kw) -> TrainingSetup:
    base = dict(architecture=L8, method="lora", micro_batch_size=4, sequence_length=2048, gradient_checkpointing=True)
    base.update(kw)
    return TrainingSetup(**base)


def test_without_a_declaration_every_example_may_be_sequence_length_long():
    padded, free = setup(), setup(padding_free=True)
    assert (padded.rows, padded.row_length) == (4, 2048)
    assert (free.rows, free.row_length) == (1, 4 * 2048)
    assert padded.tokens_per_micro_batch == free.tokens_per_micro_batch


def test_declared_tokens_bound_the_rows():
    declared = (1500, 2100, 2600)  # the longest example; 2 and 3 consecutive examples at most
    assert setup(padding_free=True, micro_batch_tokens=declared, micro_batch_size=3).row_length == 2600
    # Past the list: the last declared plus the longest example per further example.
    assert setup(padding_free=True, micro_batch_tokens=declared).row_length == 2600 + 1500
    assert setup(micro_batch_tokens=declared).row_length == 1500  # padded: to the longest example
    assert setup(micro_batch_tokens=(3000, 3500), sequence_length=2048).row_length == 2048  # cut to the sequence
    assert setup(padding_free=True, micro_batch_tokens=(3000, 5000), micro_batch_size=2).row_length == 4096
    assert setup(packing=True, micro_batch_tokens=declared).row_length == 2048  # packed bins fill up


def test_padding_free_under_flash_saves_what_padding_wastes():
    declared = (1500, 1900, 2200, 2500)
    padded = estimate_memory(setup(attention="flash", micro_batch_tokens=declared, gradient_checkpointing=False))
    free = estimate_memory(setup(attention="flash", micro_batch_tokens=declared, padding_free=True,
                                 gradient_checkpointing=False))
    undeclared = estimate_memory(setup(attention="flash", gradient_checkpointing=False))
    # 4 x 1500 padded tokens against 2500 real ones; 4 x 2048 without a declaration.
    assert free.peak_allocated_bytes < padded.peak_allocated_bytes < undeclared.peak_allocated_bytes
    assert free.breakdown["activations"] < 0.5 * padded.breakdown["activations"]


def test_a_padding_free_row_is_sized_as_a_packed_row_of_its_tokens():
    """Under sdpa and eager the collator's one row with restarting positions is what packing gives one
    packed sequence of those tokens: the same tensors, the same block-diagonal mask."""
    for attention in ("sdpa", "eager", "flash"):
        free = setup(attention=attention, padding_free=True, micro_batch_tokens=(1200, 1700, 1800))
        row = setup(attention=attention, packing=True, micro_batch_size=1, sequence_length=free.row_length,
                    gradient_accumulation=1)
        assert estimate_memory(free).peak_allocated_bytes == estimate_memory(row).peak_allocated_bytes, attention


def test_padding_free_under_sdpa_pays_for_its_mask():
    # The row's mask is (its tokens)^2: for 4 full-length examples 16 times one sequence's.
    free = estimate_memory(setup(padding_free=True, gradient_checkpointing=False))
    padded = estimate_memory(setup(gradient_checkpointing=False))
    assert free.peak_allocated_bytes > padded.peak_allocated_bytes


def test_bad_declarations_are_refused_by_name():
    with pytest.raises(SizingError, match="padding_free"):
        setup(packing=True, padding_free=True)
    for bad in ((100, 0), (300, 200)):
        with pytest.raises(SizingError, match="micro_batch_tokens"):
            setup(micro_batch_tokens=bad)


@settings(max_examples=300, deadline=None)
@given(lengths=st.lists(st.integers(1, 3000), min_size=1, max_size=200), micro=st.integers(1, 16),
       count=st.integers(1, 16), seq=st.integers(16, 4096), start=st.integers(0, 199))
def test_the_row_bounds_every_micro_batch_of_the_stream(lengths, micro, count, seq, start):
    """With the values the trainer measures on a stream (data.window_tokens, any number of them),
    every micro-batch of `micro` consecutive samples, from wherever an attempt starts, fits the row."""
    cut = [min(n, seq) for n in lengths]
    declared = tuple(window_tokens(cut, count))
    free = setup(padding_free=True, micro_batch_size=micro, sequence_length=seq, micro_batch_tokens=declared)
    padded = setup(micro_batch_size=micro, sequence_length=seq, micro_batch_tokens=declared)
    start %= len(cut)
    for k in range(start, len(cut), micro):
        batch = cut[k:k + micro]
        assert sum(batch) <= free.row_length
        assert max(batch) <= padded.row_length
    assert free.row_length <= micro * seq and padded.row_length <= seq

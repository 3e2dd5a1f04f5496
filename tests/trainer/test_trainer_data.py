"""Dataset reading, tokenizing per format, packing and the resumable sample order."""

import json

import pytest

from hypothesis import given, settings
from hypothesis import strategies as st

from finetune_trainer.data import (
    IGNORE,
    Collator,
    Example,
    build_examples,
    check_micro_batch_tokens,
    held_out_split,
    pack,
    read_jsonl,
    sample_order,
    stream_window_tokens,
    total_samples,
    window_tokens,
)
from finetune_trainer.errors import DataError

from .trainer_assets import build_tokenizer, chat_lines, write_jsonl


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return build_tokenizer(tmp_path_factory.mktemp("tok"))


def learned(tokenizer, example):
    return tokenizer.convert_ids_to_tokens([t for t, l in zip(example.input_ids, example.labels) if l != IGNORE])


def test_chat_learns_only_the_assistant_turns(tokenizer, tmp_path):
    rows = [{"messages": [
        {"role": "system", "content": "answer please"},
        {"role": "user", "content": "what colour is the sky ?"},
        {"role": "assistant", "content": "blue ."},
        {"role": "user", "content": "and the snow ?"},
        {"role": "assistant", "content": "white ."},
    ]}]
    [example] = build_examples(tokenizer, read_jsonl(write_jsonl(tmp_path / "d.jsonl", rows)), "chat", 256, False)
    assert learned(tokenizer, example) == ["blue", ".", "<|end|>", "white", ".", "<|end|>", "</s>"]


def test_instruction_masks_the_prompt(tokenizer, tmp_path):
    rows = [{"instruction": "tell me the colour of the sun", "output": "yellow ."}]
    [example] = build_examples(tokenizer, read_jsonl(write_jsonl(tmp_path / "d.jsonl", rows)), "instruction", 256, False)
    assert learned(tokenizer, example) == ["yellow", ".", "<|end|>", "</s>"]
    assert "tell" in tokenizer.convert_ids_to_tokens(example.input_ids)


def test_text_learns_everything_and_truncates(tokenizer, tmp_path):
    rows = [{"text": "the sun is yellow . " * 10}]
    [example] = build_examples(tokenizer, read_jsonl(write_jsonl(tmp_path / "d.jsonl", rows)), "text", 16, False)
    assert len(example.input_ids) == 16 and example.labels == example.input_ids


def test_packing_keeps_examples_whole_and_their_boundaries(tokenizer, tmp_path):
    records = read_jsonl(write_jsonl(tmp_path / "d.jsonl", chat_lines(20)))
    unpacked = build_examples(tokenizer, records, "chat", 64, False)
    packed = build_examples(tokenizer, records, "chat", 64, True)
    assert len(packed) < len(unpacked) and all(len(e.input_ids) <= 64 for e in packed)
    # Every example is in exactly one packed sequence, whole, its positions from 0, and its first
    # token is not a target (the token before it belongs to another example).
    found = []
    for sequence in packed:
        starts = [i for i, p in enumerate(sequence.position_ids) if p == 0] + [len(sequence.input_ids)]
        assert starts[0] == 0 and sequence.position_ids == [p for a, b in zip(starts, starts[1:]) for p in range(b - a)]
        for a, b in zip(starts, starts[1:]):
            found.append((sequence.input_ids[a:b], sequence.labels[a + 1:b]))
            assert sequence.labels[a] == IGNORE
    assert sorted(found) == sorted((e.input_ids, e.labels[1:]) for e in unpacked)
    assert [e.input_ids for e in build_examples(tokenizer, records, "chat", 64, True)] == [e.input_ids for e in packed]


@settings(max_examples=200, deadline=None)
@given(lengths=st.lists(st.integers(1, 40), min_size=1, max_size=60), room=st.integers(1, 48))
def test_packing_is_a_best_fit_of_whole_examples(lengths, room):
    examples = [Example(list(range(100 * i, 100 * i + n)), list(range(100 * i, 100 * i + n))) for i, n in enumerate(lengths)]
    packed = pack(examples, room)
    cut = sorted(tuple(e.input_ids[:room]) for e in examples)
    pieces = []
    for sequence in packed:
        assert 0 < len(sequence.input_ids) <= room
        starts = [i for i, p in enumerate(sequence.position_ids) if p == 0] + [len(sequence.input_ids)]
        pieces.extend(tuple(sequence.input_ids[a:b]) for a, b in zip(starts, starts[1:]))
    assert sorted(pieces) == cut  # nothing lost, nothing split, nothing twice
    # Best fit never opens a sequence an example would have fitted into: any two sequences hold
    # more than `room` tokens together, so at most one is half empty or less.
    assert sum(len(s.input_ids) <= room / 2 for s in packed) <= 1


def test_a_packed_sequence_attends_within_each_example_only(tmp_path):
    """The logits of an example inside a packed sequence are those of the example alone, for
    sdpa and eager attention, through the collator as the trainer uses it."""
    import torch

    from .trainer_assets import build_model

    path = tmp_path / "m"
    build_model(path, vocab_size=64)
    from transformers import AutoModelForCausalLM

    first, second = Example([3, 9, 4, 7, 5], [3, 9, 4, 7, 5]), Example([8, 2, 6], [8, 2, 6])
    [sequence] = pack([first, second], 16)
    assert sequence.input_ids == first.input_ids + second.input_ids
    for attention in ("sdpa", "eager"):
        # As the trainer loads it (model_setup): with the KV cache on, transformers ignores packing.
        model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=attention, use_cache=False).eval()
        batch = Collator(pad_token_id=0)([sequence.item(), Example([1, 2], [1, 2], [0, 1]).item()])
        assert "attention_mask" not in batch and batch.pop("token_count").item() == 10
        with torch.no_grad():
            together = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits[0]
            alone = {len(e.input_ids): model(input_ids=torch.tensor([e.input_ids])).logits[0] for e in (first, second)}
        # Longest first: the five tokens, then the three.
        torch.testing.assert_close(together[:5], alone[5], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(together[5:8], alone[3], rtol=1e-4, atol=1e-4)


def test_collator_pads_packed_sequences_with_a_run_of_their_own_or_flattens_them():
    a = Example([5, 6, 7], [IGNORE, 6, 7], [0, 1, 0]).item()
    b = Example([8], [IGNORE], [0]).item()
    batch = Collator(pad_token_id=0)([a, b])
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0]]
    assert batch["labels"].tolist() == [[IGNORE, 6, 7], [IGNORE, IGNORE, IGNORE]]
    assert batch["position_ids"].tolist() == [[0, 1, 0], [0, 0, 1]]
    assert "attention_mask" not in batch and batch["token_count"].item() == 4
    flat = Collator(pad_token_id=0, flatten=True)([a, b])
    assert flat["input_ids"].tolist() == [[5, 6, 7, 8]] and flat["position_ids"].tolist() == [[0, 1, 0, 0]]
    with pytest.raises(ValueError, match="mixes packed and unpacked"):
        Collator(pad_token_id=0)([a, {"input_ids": [1], "labels": [1]}])


def test_malformed_line_is_a_data_error_naming_the_line(tmp_path):
    path = tmp_path / "d.jsonl"
    lines = [json.dumps(r) for r in chat_lines(3)]
    lines.insert(2, '{"messages": [ oops')
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError, match=r"line 3 of .*d\.jsonl is not valid JSON"):
        read_jsonl(path)


@pytest.mark.parametrize(
    "row, fmt, needle",
    [
        ({"text": 5}, "text", "'text' must be a string"),
        ({"prompt": "x"}, "text", "has no 'text' field"),
        ({"messages": []}, "chat", "non-empty 'messages'"),
        ({"messages": [{"role": "user", "content": "hi"}]}, "chat", "no assistant message"),
        ({"instruction": "x"}, "instruction", "'response'"),
    ],
)
def test_wrong_fields_name_the_line(tokenizer, tmp_path, row, fmt, needle):
    records = read_jsonl(write_jsonl(tmp_path / "d.jsonl", [{"text": "a"}, row] if fmt == "text" else [row]))
    with pytest.raises(DataError, match=needle) as info:
        build_examples(tokenizer, records, fmt, 64, False)
    assert "d.jsonl:" in str(info.value)


def test_missing_and_empty_dataset(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        read_jsonl(tmp_path / "nope.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(DataError, match="is empty"):
        read_jsonl(tmp_path / "empty.jsonl")


def test_sample_order_is_one_stream_whatever_the_split():
    whole = sample_order(10, 0, 57, seed=7)
    assert sorted(whole[:10]) == list(range(10)) and sorted(whole[10:20]) == list(range(10))
    # Resuming anywhere continues the same stream.
    for start in (0, 3, 10, 24, 50):
        assert sample_order(10, start, 57 - start, seed=7) == whole[start:]
    assert sample_order(10, 0, 10, seed=8) != whole[:10]
    assert total_samples(64, 1.5) == 96


def test_collator_pads_with_ignored_labels():
    batch = Collator(pad_token_id=0)([{"input_ids": [5, 6, 7], "labels": [IGNORE, 6, 7]},
                                      {"input_ids": [8], "labels": [8]}])
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0]]
    assert batch["labels"].tolist() == [[IGNORE, 6, 7], [8, IGNORE, IGNORE]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch["token_count"].item() == 4


def test_the_held_out_split_is_the_seeds_alone_and_a_split_leaving_a_side_empty_names_the_field():
    from finetune_trainer.data import Example, held_out_digest, held_out_split

    examples = [Example([i, i + 1], [i, i + 1]) for i in range(40)]
    train, held = held_out_split(examples, 0.25, seed=3)
    assert len(held) == 10 and len(train) == 30 and not {e.input_ids[0] for e in train} & {e.input_ids[0] for e in held}
    assert [e.input_ids for e in train] == sorted(e.input_ids for e in train)  # training keeps its order
    again_train, again_held = held_out_split(list(examples), 0.25, seed=3)
    assert held_out_digest(again_held) == held_out_digest(held) and again_train == train
    assert held_out_digest(held_out_split(examples, 0.25, seed=4)[1]) != held_out_digest(held)
    with pytest.raises(DataError, match=r"spec.evaluation.heldOutFraction 0.01 of 40 sequences holds out 0"):
        held_out_split(examples, 0.01, seed=3)
    with pytest.raises(DataError, match="heldOutFraction"):
        held_out_split(examples[:1], 0.5, seed=3)


def test_padding_free_examples_carry_their_boundaries_and_the_collator_lays_them_in_one_row(tokenizer, tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": "a b c d e"}, {"text": "f g"}])
    plain = build_examples(tokenizer, read_jsonl(path), "text", 64, packing=False)
    free = build_examples(tokenizer, read_jsonl(path), "text", 64, packing=False, padding_free=True)
    for p, f in zip(plain, free):
        assert f.input_ids == p.input_ids and f.labels == [IGNORE] + p.labels[1:]
        assert f.position_ids == list(range(len(p.input_ids)))
    batch = Collator(pad_token_id=0, flatten=True)([e.item() for e in free])
    assert batch["input_ids"].tolist() == [free[0].input_ids + free[1].input_ids]
    assert "attention_mask" not in batch and batch["token_count"].item() == sum(len(e.input_ids) for e in free)


def test_window_tokens_are_the_most_any_consecutive_samples_hold():
    assert window_tokens([5, 1, 7, 2, 6], 3) == [7, 9, 15]
    assert window_tokens([4, 3], 4) == [4, 7, 7, 7]  # windows past the stream: the whole stream


@settings(max_examples=200, deadline=None)
@given(lengths=st.lists(st.integers(1, 500), min_size=1, max_size=60), count=st.integers(1, 12))
def test_window_tokens_against_every_window(lengths, count):
    found = window_tokens(lengths, count)
    for b in range(1, count + 1):
        windows = [sum(lengths[i:i + b]) for i in range(max(1, len(lengths) - b + 1))]
        assert found[b - 1] == max(windows)


def test_the_declared_micro_batch_tokens_are_checked_against_the_run_stream():
    examples = [Example([1] * n, [1] * n) for n in (50, 10, 30, 30, 20)]
    measured = stream_window_tokens(examples, seed=42, samples=12, count=3)
    order = sample_order(5, 0, 12, 42)
    assert measured == window_tokens([len(examples[i].input_ids) for i in order], 3)
    check_micro_batch_tokens(measured, measured)
    check_micro_batch_tokens([m + 1 for m in measured], measured)
    check_micro_batch_tokens(None, measured)
    check_micro_batch_tokens(measured[:1], measured)
    short = list(measured)
    short[1] -= 1
    with pytest.raises(DataError) as error:
        check_micro_batch_tokens(short, measured)
    assert str(error.value).startswith(
        f"spec.dataset.microBatchTokens: 2 consecutive examples of this job's sample order hold {measured[1]} tokens, "
        f"more than the {short[1]} declared; the data holds {measured}")


def test_dataset_stats_prints_what_the_trainer_checks(tokenizer, tmp_path, capsys):
    from finetune_operator.api.spec import DatasetSpec
    from finetune_operator.api.training import TrainingSpec
    from finetune_trainer import dataset_stats
    from finetune_trainer.run import plan_run
    from finetune_trainer.contract import TrainerConfig

    # Its defaults are the API's.
    assert dataset_stats.DEFAULT_FORMAT == DatasetSpec.model_fields["format"].default
    assert dataset_stats.DEFAULT_SEQUENCE_LENGTH == TrainingSpec.model_fields["sequence_length"].default
    assert dataset_stats.DEFAULT_SEED == TrainingSpec.model_fields["seed"].default
    assert dataset_stats.percentiles([9, 5, 4, 1]) == {"p50": 4, "p90": 9, "p99": 9, "max": 9}

    tokenizer.save_pretrained(tmp_path / "tok")
    rows = [{"text": " ".join("abcdefgh"[: 1 + i % 8])} for i in range(20)]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    assert dataset_stats.main([str(path), "--tokenizer", str(tmp_path / "tok"), "--format", "text",
                               "--sequence-length", "6", "--global-batch-size", "4", "--epochs", "1.5",
                               "--held-out-fraction", "0.2", "--count", "8"]) == 0
    printed = json.loads(capsys.readouterr().out)
    examples = build_examples(tokenizer, read_jsonl(path), "text", 6, packing=False)
    examples, _ = held_out_split(examples, 0.2, 42)
    # The samples the trainer's own plan trains on, and the values its check passes.
    cfg = TrainerConfig.model_validate({
        "jobName": "j", "model": {"path": str(tmp_path)}, "dataset": {"path": str(path), "format": "text"},
        "method": "full", "epochs": 1.5, "microBatchSize": 2, "gradientAccumulation": 2,
        "outputDirectory": str(tmp_path / "o"), "sequenceLength": 8})
    plan = plan_run(cfg, len(examples), 1, None)
    assert printed["examples"] == len(examples) and printed["samples"] == plan.max_steps * plan.global_batch
    assert printed["microBatchTokens"] == stream_window_tokens(examples, 42, printed["samples"], 8)
    assert printed["max"] <= 6 and printed["microBatchTokens"][0] == printed["max"]


def test_padding_free_batches_are_what_transformers_flattening_collator_makes(tokenizer, tmp_path):
    """The trainer keeps its own collator (it also lays packed sequences out and counts real tokens);
    for padding-free examples its row is transformers' DataCollatorWithFlattening's, tensor for tensor."""
    from transformers import DataCollatorWithFlattening

    path = write_jsonl(tmp_path / "d.jsonl", [{"text": "a b c d e"}, {"text": "f g"}, {"text": "h i j"}])
    plain = build_examples(tokenizer, read_jsonl(path), "text", 64, packing=False)
    free = build_examples(tokenizer, read_jsonl(path), "text", 64, packing=False, padding_free=True)
    ours = Collator(pad_token_id=0, flatten=True)([e.item() for e in free])
    theirs = DataCollatorWithFlattening(return_tensors="pt")([{"input_ids": e.input_ids, "labels": e.labels}
                                                              for e in plain])
    for key in ("input_ids", "labels", "position_ids"):
        assert ours[key].tolist() == theirs[key].tolist(), key

"""Dataset reading, tokenizing per format, packing and the resumable sample order."""

import json

import pytest

from finetune_trainer.data import (
    IGNORE,
    Collator,
    build_examples,
    read_jsonl,
    sample_order,
    total_samples,
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


def test_packing_fills_blocks(tokenizer, tmp_path):
    records = read_jsonl(write_jsonl(tmp_path / "d.jsonl", chat_lines(20)))
    unpacked = build_examples(tokenizer, records, "chat", 64, False)
    packed = build_examples(tokenizer, records, "chat", 64, True)
    assert all(len(e.input_ids) == 64 for e in packed[:-1])
    assert sum(len(e.input_ids) for e in packed) == sum(len(e.input_ids) for e in unpacked)
    assert len(packed) < len(unpacked)


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

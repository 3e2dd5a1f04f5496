"""Read the JSONL dataset, tokenize it per format, pack or truncate, and order it.

Labels are -100 where the model must not learn: prompts and chat turns other than
the assistant's. Packing keeps each example whole and its boundaries: every example of a
packed sequence numbers its positions from 0, and the collator passes those position ids
(with no attention mask), from which transformers builds attention that never crosses an
example (sdpa and eager: a block-diagonal causal mask; flash: its variable-length kernel).
Padding-free (unpacked examples, spec.dataset.paddingFree) marks each example's boundary the same
way, and the collator lays a micro-batch's examples end to end in one row.

The sample order of a whole run is a pure function of the seed, so a resumed attempt can
skip exactly the samples earlier attempts consumed, whatever the micro-batch, accumulation
or GPU count of each attempt.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from .errors import DataError

IGNORE = -100


@dataclass(frozen=True)
class Record:
    source: str  # "path:line" for error messages
    data: dict[str, Any]


@dataclass
class Example:
    input_ids: list[int]
    labels: list[int]
    position_ids: list[int] | None = None
    """Packed sequences only: each example's positions, from 0 at its first token."""

    def item(self) -> dict[str, list[int]]:
        """The example as the collator takes it."""
        found = {"input_ids": self.input_ids, "labels": self.labels}
        if self.position_ids is not None:
            found["position_ids"] = self.position_ids
        return found


def dataset_files(path: str | Path) -> list[Path]:
    """The files a dataset path stands for: the file itself, or every ``*.jsonl`` in a directory
    (sorted). The one rule for both reading them and recording what was read (provenance.py)."""
    path = Path(path)
    if path.is_dir():
        files = sorted(path.glob("*.jsonl"))
        if not files:
            raise DataError(f"dataset directory {path} holds no *.jsonl files")
        return files
    if path.is_file():
        return [path]
    raise DataError(f"dataset {path} does not exist")


def read_jsonl(path: str | Path) -> list[Record]:
    """All records of a JSONL file, or of every ``*.jsonl`` in a directory (sorted)."""
    path = Path(path)
    records: list[Record] = []
    for file in dataset_files(path):
        with open(file, encoding="utf-8") as handle:
            for number, line in enumerate(_lines(handle, file), start=1):
                if not line.strip():
                    continue
                where = f"{file}:{number}"
                try:
                    data = json.loads(line)
                except ValueError as exc:
                    raise DataError(f"dataset line {number} of {file} is not valid JSON: {exc}") from exc
                if not isinstance(data, dict):
                    raise DataError(f"dataset line {number} of {file} is not a JSON object")
                records.append(Record(where, data))
    if not records:
        raise DataError(f"dataset {path} is empty")
    return records


def _lines(handle, file: Path) -> Iterator[str]:
    try:
        yield from handle
    except UnicodeDecodeError as exc:
        raise DataError(f"dataset {file} is not UTF-8: {exc}") from exc


def _field(record: Record, key: str, required: bool = True) -> str | None:
    value = record.data.get(key)
    if value is None:
        if required:
            raise DataError(f"dataset line {record.source} has no {key!r} field")
        return None
    if not isinstance(value, str):
        raise DataError(f"dataset line {record.source}: {key!r} must be a string")
    return value


def _messages(record: Record) -> list[dict[str, str]]:
    messages = record.data.get("messages")
    if not isinstance(messages, list) or not messages:
        raise DataError(f"dataset line {record.source} needs a non-empty 'messages' list")
    for i, message in enumerate(messages):
        if (
            not isinstance(message, dict)
            or not isinstance(message.get("role"), str)
            or not isinstance(message.get("content"), str)
        ):
            raise DataError(
                f"dataset line {record.source}: messages[{i}] needs string 'role' and 'content'"
            )
    if not any(m["role"] == "assistant" for m in messages):
        raise DataError(f"dataset line {record.source}: no assistant message to learn from")
    return messages


def instruction_messages(record: Record) -> list[dict[str, str]]:
    instruction = _field(record, "instruction")
    extra = _field(record, "input", required=False)
    response = record.data.get("response", record.data.get("output"))
    if not isinstance(response, str):
        raise DataError(f"dataset line {record.source} needs a string 'response' (or 'output')")
    prompt = f"{instruction}\n\n{extra}" if extra else instruction
    return [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]


def encode_chat(tokenizer, messages: list[dict[str, str]], source: str) -> Example:
    """Render with the chat template; learn only the assistant turns.

    The character span of each assistant turn is found by rendering the conversation
    up to it (with the generation prompt) and up to its end; tokens whose first
    character falls in a span get labels.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(f"dataset line {source}: format chat needs a tokenizer with a chat template")
    full = tokenizer.apply_chat_template(messages, tokenize=False)
    spans: list[tuple[int, int]] = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = tokenizer.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True) if i else ""
        through = tokenizer.apply_chat_template(messages[: i + 1], tokenize=False)
        if not full.startswith(through) or not through.startswith(before):
            # A template that is not prefix-stable: learn the whole conversation.
            spans = [(0, len(full))]
            break
        spans.append((len(before), len(through)))
    encoded = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(encoded["input_ids"])
    labels = [
        tok if any(start <= begin < end for start, end in spans) else IGNORE
        for tok, (begin, _) in zip(ids, encoded["offset_mapping"])
    ]
    if tokenizer.eos_token_id is not None and (not ids or ids[-1] != tokenizer.eos_token_id):
        ids.append(tokenizer.eos_token_id)
        labels.append(tokenizer.eos_token_id)
    return Example(ids, labels)


def encode_text(tokenizer, text: str) -> Example:
    ids = list(tokenizer(text)["input_ids"])
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return Example(ids, list(ids))


def encode(tokenizer, record: Record, fmt: str) -> Example:
    if fmt == "text":
        return encode_text(tokenizer, _field(record, "text"))
    if fmt == "chat":
        return encode_chat(tokenizer, _messages(record), record.source)
    if fmt == "instruction":
        messages = instruction_messages(record)
        if getattr(tokenizer, "chat_template", None):
            return encode_chat(tokenizer, messages, record.source)
        prompt = tokenizer(messages[0]["content"] + "\n")["input_ids"]
        answer = encode_text(tokenizer, messages[1]["content"])
        # Tokenizing the answer alone may add a BOS again; drop it.
        if tokenizer.bos_token_id is not None and answer.input_ids[:1] == [tokenizer.bos_token_id]:
            answer = Example(answer.input_ids[1:], answer.labels[1:])
        return Example(list(prompt) + answer.input_ids, [IGNORE] * len(prompt) + answer.labels)
    raise DataError(f"unknown dataset format {fmt!r}")


def build_examples(tokenizer, records: list[Record], fmt: str, sequence_length: int, packing: bool,
                   padding_free: bool = False) -> list[Example]:
    encoded = [encode(tokenizer, r, fmt) for r in records]
    examples = [Example(e.input_ids[:sequence_length], e.labels[:sequence_length]) for e in encoded]
    # An example whose learnable tokens were all cut off teaches nothing (and makes the
    # loss NaN when a micro-batch holds only such examples); packed, it would only take room.
    examples = [e for e in examples if any(label != IGNORE for label in e.labels[1:])]
    if not examples:
        raise DataError(
            f"no example keeps a learnable token within sequenceLength {sequence_length}"
        )
    if packing:
        return pack(examples, sequence_length)
    if padding_free:
        return [bounded(e) for e in examples]
    return examples


def bounded(example: Example) -> Example:
    """The example with its boundary marked, as packing and padding-free lay examples end to end:
    positions from 0 and its first token no target (the token before it belongs to another example;
    alone it is never one anyway)."""
    return Example(example.input_ids, [IGNORE] + example.labels[1:], list(range(len(example.input_ids))))


def window_tokens(lengths: list[int], count: int) -> list[int]:
    """[w_1, ..., w_count]: w_b is the most tokens any b consecutive of `lengths` hold (a window
    longer than the stream holds the whole stream)."""
    import numpy as np  # transformers' dependency: vectorised, a million samples x 64 values in about 0.5 s

    prefix = np.concatenate(([0], np.cumsum(np.asarray(lengths, dtype=np.int64))))
    found = [int((prefix[b:] - prefix[:-b]).max()) for b in range(1, min(count, len(lengths)) + 1)]
    return found + [int(prefix[-1])] * (count - len(found))


def stream_window_tokens(examples: list[Example], seed: int, samples: int, count: int) -> list[int]:
    """window_tokens of the run's sample stream: the `samples` samples the run trains on, in order
    (sample_order). A micro-batch of b is b consecutive samples of it on every rank (the sampler is
    sequential and accelerate deals whole batches to the ranks in turn), wherever an attempt resumes,
    so w_b bounds every micro-batch of b the run can make."""
    lengths = [len(examples[i].input_ids) for i in sample_order(len(examples), 0, samples, seed)]
    return window_tokens(lengths, count)


def check_micro_batch_tokens(declared: list[int] | None, measured: list[int]) -> None:
    """The run's stream against spec.dataset.microBatchTokens, which the plan was sized for. Raises a
    DataError naming the field and the right values before any GPU memory is spent on a plan that
    does not hold."""
    if not declared:
        return
    measured = measured[:len(declared)]
    for b, (said, holds) in enumerate(zip(declared, measured), start=1):
        if holds > said:
            raise DataError(
                f"spec.dataset.microBatchTokens: {b} consecutive examples of this job's sample order hold "
                f"{holds} tokens, more than the {said} declared; the data holds {measured} (python -m "
                f"finetune_trainer.dataset_stats prints them), or omit the field")


def pack(examples: list[Example], sequence_length: int) -> list[Example]:
    """Whole examples (each cut to ``sequence_length``) packed into sequences of at most
    ``sequence_length`` tokens, best fit in decreasing length (ties in dataset order), so the
    packing is a pure function of the data and every attempt trains on the same sequences.

    No example is split across two sequences and none sees another: positions restart at 0
    for each, and the first token of each is not a target (the token before it belongs to
    another example; for the sequence's first example it is never one anyway)."""
    cut = [Example(e.input_ids[:sequence_length], e.labels[:sequence_length]) for e in examples]
    if any(len(e.input_ids) == 0 for e in cut):
        raise ValueError("pack: an empty example")
    order = sorted(range(len(cut)), key=lambda i: (-len(cut[i].input_ids), i))
    bins: list[list[int]] = []  # example indices per packed sequence
    free: list[tuple[int, int]] = []  # (room left, bin index), sorted: the best fit is the first with room
    for i in order:
        size = len(cut[i].input_ids)
        at = bisect.bisect_left(free, (size, -1))
        if at == len(free):
            bins.append([i])
            room, index = sequence_length - size, len(bins) - 1
        else:
            room, index = free.pop(at)
            bins[index].append(i)
            room -= size
        if room > 0:
            bisect.insort(free, (room, index))
    packed = []
    for members in bins:
        ids: list[int] = []
        labels: list[int] = []
        positions: list[int] = []
        for i in members:
            member = bounded(cut[i])
            ids.extend(member.input_ids)
            labels.extend(member.labels)
            positions.extend(member.position_ids)
        packed.append(Example(ids, labels, positions))
    return packed


def sample_order(num_examples: int, start: int, count: int, seed: int) -> list[int]:
    """Indices of samples ``start .. start+count`` of the run's endless stream.

    The stream is one seeded permutation per epoch, concatenated.
    """
    order: list[int] = []
    epoch = start // num_examples
    offset = start % num_examples
    while len(order) < count:
        permutation = list(range(num_examples))
        random.Random(seed * 1_000_003 + epoch).shuffle(permutation)
        order.extend(permutation[offset:])
        offset = 0
        epoch += 1
    return order[:count]


HELD_OUT_SALT = 7_919  # the held-out split draws from its own stream, not the epochs' shuffles


def eval_examples(tokenizer, source, sequence_length: int) -> list[Example]:
    """The sequences of a separate evaluation dataset (spec.evaluation.dataset), built like the
    training data's; a dataset that is missing, unreadable or yields nothing is a DataError naming
    the field."""
    try:
        records = read_jsonl(source.path)
        examples = build_examples(tokenizer, records, source.format, sequence_length, source.packing,
                                  source.padding_free)
    except DataError as error:
        raise DataError(f"spec.evaluation.dataset: {error}") from error
    except OSError as error:
        raise DataError(f"spec.evaluation.dataset: cannot read {source.path}: {error}") from error
    if not examples:
        raise DataError(f"spec.evaluation.dataset: {source.path} yields no sequence to evaluate on")
    return examples


def held_out_digest(held_out: list[Example]) -> str:
    """sha256 of the held-out sequences' tokens: two attempts that evaluate on the same samples say so."""
    digest = hashlib.sha256()
    for example in held_out:
        digest.update(json.dumps(example.input_ids).encode())
        digest.update(b"\n")
    return digest.hexdigest()


def held_out_split(examples: list[Example], fraction: float, seed: int) -> tuple[list[Example], list[Example]]:
    """(training, held-out) sequences: round(fraction x n) of them, chosen by the seed alone, so
    every attempt of a job (and every rank) holds out the same ones. The training part keeps its
    order. A split that leaves either side empty is a DataError naming the field."""
    count = round(len(examples) * fraction)
    if count < 1 or count >= len(examples):
        raise DataError(f"spec.evaluation.heldOutFraction {fraction} of {len(examples)} sequences holds out "
                        f"{count}: it must leave at least one sequence for evaluation and one for training")
    chosen = set(random.Random(seed * 1_000_003 + HELD_OUT_SALT).sample(range(len(examples)), count))
    training = [e for i, e in enumerate(examples) if i not in chosen]
    held_out = [e for i, e in enumerate(examples) if i in chosen]
    return training, held_out


def total_samples(num_examples: int, epochs: float) -> int:
    return max(1, math.ceil(num_examples * epochs))


class Collator:
    """Makes a micro-batch of examples. Unpacked ones are padded to the longest (labels -100)
    with an attention mask. Packed ones carry position ids and no mask: a shorter sequence is
    padded with a run of pad tokens numbered as an example of its own, which attends to nothing
    real and is never a target; with ``flatten`` (flash attention, whose variable-length kernel
    reads the boundaries only from one row) the micro-batch becomes one row, with no padding.

    With ``sequence_shards`` > 1 (sequence parallelism: DeepSpeed's adapter slices every tensor of the
    batch along the sequence over that many ranks) the rows are padded to a multiple of it, and unpacked
    rows carry position ids in place of the mask: Ulysses drops the mask and orders attention by the
    position ids (right padding comes after every real token, so causal attention never reads it).

    Each batch says how many of its tokens are real (``token_count``): the trainer counts them
    as trained tokens and takes the key out before the model sees the batch. Under sequence
    parallelism it is a plain int: the adapter slices every tensor along the sequence and copies
    other values to each rank of the group."""

    def __init__(self, pad_token_id: int, flatten: bool = False, sequence_shards: int = 1):
        self.pad_token_id = pad_token_id
        self.flatten = flatten
        self.sequence_shards = sequence_shards

    def __call__(self, batch: list[dict[str, list[int]]]):
        import torch

        packed = all("position_ids" in item for item in batch)
        if not packed and any("position_ids" in item for item in batch):
            raise ValueError("a micro-batch mixes packed and unpacked examples")
        rows = [(item["input_ids"], item["labels"], item.get("position_ids")) for item in batch]
        if packed and self.flatten:
            rows = [tuple([value for row in rows for value in row[k]] for k in range(3))]
        shards = self.sequence_shards
        longest = max(len(ids) for ids, _, _ in rows)
        longest = -(-longest // shards) * shards
        input_ids, labels, extra = [], [], []
        for ids, row_labels, positions in rows:
            pad = longest - len(ids)
            input_ids.append(list(ids) + [self.pad_token_id] * pad)
            labels.append(list(row_labels) + [IGNORE] * pad)
            if packed:  # the pad run is numbered as an example of its own
                extra.append(list(positions) + list(range(pad)))
            elif shards > 1:  # positions only: Ulysses drops the mask
                extra.append(list(range(longest)))
            else:  # masked out
                extra.append([1] * len(ids) + [0] * pad)
        count = sum(len(item["input_ids"]) for item in batch)
        return {
            "input_ids": torch.tensor(input_ids, dtype=torch.long),
            "labels": torch.tensor(labels, dtype=torch.long),
            ("position_ids" if packed or shards > 1 else "attention_mask"): torch.tensor(extra, dtype=torch.long),
            "token_count": count if shards > 1 else torch.tensor(count, dtype=torch.long),
        }

"""The trainer's record of what it read: one digest per file, one for the dataset."""

from __future__ import annotations

import hashlib

import pytest

from finetune_trainer.contract import SuccessReport, parse_success_report
from finetune_trainer.errors import DataError
from finetune_trainer.provenance import AttemptFacts, FileDigest, combined_digest, dataset_digests


def test_a_directory_dataset_lists_every_jsonl_file_with_its_digest_and_nothing_else(tmp_path):
    (tmp_path / "b.jsonl").write_text('{"text": "b"}\n')
    (tmp_path / "a.jsonl").write_text('{"text": "a"}\n')
    (tmp_path / "notes.txt").write_text("not read by the trainer, so not recorded")
    files = dataset_digests(tmp_path)
    assert [f.name for f in files] == ["a.jsonl", "b.jsonl"]
    assert files[0].sha256 == hashlib.sha256(b'{"text": "a"}\n').hexdigest() and files[0].bytes == 14


def test_the_dataset_digest_changes_with_any_file_its_name_or_its_order():
    a, b = FileDigest("a.jsonl", "1" * 64, 1), FileDigest("b.jsonl", "2" * 64, 1)
    base = combined_digest([a, b])
    assert combined_digest([a, b]) == base
    assert combined_digest([b, a]) != base
    assert combined_digest([a, FileDigest("c.jsonl", b.sha256, 1)]) != base
    assert combined_digest([a, FileDigest("b.jsonl", "3" * 64, 1)]) != base
    assert combined_digest([a]) != base


def test_a_missing_dataset_is_the_data_error_reading_it_gives(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        dataset_digests(tmp_path / "absent.jsonl")


def test_the_facts_of_a_large_dataset_fit_in_the_termination_message():
    files = [FileDigest(f"part-{i:05d}.jsonl", "f" * 64, 1 << 30) for i in range(5000)]
    facts = AttemptFacts(files, "e" * 64, records=10**9, examples=10**8, tokens=10**12, final_loss=1.2345)
    report = SuccessReport(steps=100000, peak_allocated_bytes=70 << 30, peak_reserved_bytes=75 << 30,
                           device_total_bytes=80 << 30, world_size=1024, attempt=12, facts=facts.summary())
    text = report.to_termination_message()
    assert len(text) < 4096 and parse_success_report(text) == report
    assert report.facts is not None and report.facts.dataset_files == 5000

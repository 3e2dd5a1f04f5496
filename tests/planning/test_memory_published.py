"""bench/memory_published.py: every published memory row names a pinned source and a known metric, and every
row the model can be asked about is estimated (no torch needed)."""

from __future__ import annotations

import math
import re
import sys
from .bench_module import load_bench

PINNED = re.compile(r"^https://github\.com/[\w.-]+/[\w.-]+/blob/[0-9a-f]{40}/\S+$")


def _bench():
    return load_bench("memory_published")


def test_rows_name_a_pinned_source_a_known_metric_and_a_unique_key():
    bench = _bench()
    rows = bench.ROWS
    assert len({r.key for r in rows}) == len(rows)
    known = set(sys.modules["memory_published_rows"].METRICS)  # imported by the bench module
    for r in rows:
        assert PINNED.match(r.source), (r.key, r.source)
        assert r.metric in known, r.key
        assert r.split in ("in-sample", "held-out"), r.key
        assert r.method in ("full", "lora", "qlora"), r.key
        assert r.published_gib > 0 and r.published, r.key
        assert r.not_expressible is None or len(r.not_expressible) > 20, r.key


def test_every_expressible_row_is_estimated_and_the_table_is_large_enough():
    bench = _bench()
    results = bench.evaluate()
    assert len(results) == len(bench.ROWS)
    expressible = [r for r in results if not r.row.not_expressible]
    assert len(expressible) >= 25
    for r in expressible:
        assert r.left_out is None, (r.row.key, r.left_out)
        assert r.predicted_gib is not None and math.isfinite(r.predicted_gib) and r.predicted_gib > 0, r.row.key
        if r.row.metric in ("reserved", "nvidia-smi"):
            assert r.factor is not None and r.factor >= 1.0, r.row.key
            assert r.predicted_gib >= r.peak_allocated_gib, r.row.key
        else:
            assert r.predicted_gib == r.peak_allocated_gib, r.row.key
    for r in results:
        if r.row.not_expressible:
            assert r.predicted_gib is None and r.left_out == r.row.not_expressible, r.row.key
    lines = bench.summary_lines(results)
    assert any(line.startswith("goal (") for line in lines)
    assert any(line.startswith("allocated") for line in lines)
    data = bench.to_json(results)
    assert len(data["rows"]) == len(results) and "held-out" in data["goal"]


def test_a_row_that_raises_is_left_out_with_the_message():
    bench = _bench()
    from dataclasses import replace

    row = replace(bench.ROWS[0], key="bad", micro_batch=0, not_expressible=None)
    result = bench.predict(row)
    assert result.predicted_gib is None and "micro_batch_size" in result.left_out

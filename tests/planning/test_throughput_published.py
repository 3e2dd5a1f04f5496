"""bench/throughput_published.py: every published row is put to the planner's step-time model, or is
listed with why it cannot be."""

from __future__ import annotations

import math

from .bench_module import load_bench


def _bench():
    return load_bench("throughput_published")


def test_every_published_row_is_predicted_or_left_out_with_a_reason():
    bench = _bench()
    results = bench.evaluate()
    assert len(results) == len(bench.ROWS) and len({r.row.key for r in results}) == len(results)
    for r in results:
        assert r.row.source.startswith("https://") and r.row.tokens_per_s_per_gpu > 0, r.row.key
        assert r.row.split in ("in-sample", "held-out"), r.row.key
        if r.left_out is None:
            assert r.predicted is not None and math.isfinite(r.predicted) and r.predicted > 0, r.row.key
            assert 0 < r.utilisation <= bench.MAX_UTILISATION, r.row.key
        else:
            assert r.predicted is None and len(r.left_out) > 20, r.row.key
    compared = [r for r in results if r.error is not None]
    assert {r.row.split for r in compared} == {"in-sample", "held-out"}
    assert "median |err|" in bench.summary(compared)

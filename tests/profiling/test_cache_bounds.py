"""The profile cache stays under the ConfigMap size limit: what a write evicts (profiling/cache.py)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from finetune_operator.profiling.cache import data_bytes, evictions, model_entry, written_entry


def _model(digest: str, size: int, written: str | None) -> dict[str, str]:
    entries = {model_entry(digest): "m" * size, f"{digest}.0123456789abcdef": "s" * size}
    if written is not None:
        entries[written_entry(digest)] = written
    return entries


def _models(keys) -> set[str]:
    return {key.split(".")[0] for key in keys}


_days = st.one_of(st.none(), st.dates().map(lambda d: f"{d.isoformat()}T00:00:00Z"))


@settings(max_examples=300, deadline=None)
@given(cached=st.lists(st.tuples(st.integers(1, 400), _days), max_size=25),
       new_size=st.integers(1, 400), rewrite=st.booleans(), budget=st.integers(500, 12_000))
def test_a_write_evicts_whole_models_least_recently_written_first_until_it_fits(cached, new_size, rewrite, budget):
    data: dict[str, str] = {}
    for n, (size, written) in enumerate(cached):
        data.update(_model(f"{n:04x}", size, written))
    # The write: a model already in the cache (its entries written again) or a new one.
    digest = "0000" if rewrite and cached else "ffff"
    entries = _model(digest, new_size, "2030-01-01T00:00:00Z")
    evicted = evictions(data, entries, budget)

    def age(model: str) -> str:
        return data.get(written_entry(model), "")

    after = {key: value for key, value in {**data, **entries}.items() if key not in evicted}

    assert all(value is None for value in evicted.values())
    assert not any(key.startswith(digest + ".") for key in evicted), "never the model being written"
    assert not _models(evicted) & _models(after), "whole models go"
    if data_bytes({**data, **entries}) <= budget:
        assert evicted == {}
    else:
        others = _models(after) - {digest}
        assert data_bytes(after) <= budget or not others, "fits, or only the model being written is left"
        # Least recently written first; a model that never said when it was written counts as oldest.
        if evicted and others:
            assert max(age(d) for d in _models(evicted)) <= min(age(d) for d in others)
        # And no more than needed: keeping the last model evicted would not have fitted.
        if evicted:
            last = max(_models(evicted), key=lambda d: (age(d), d))
            back = {key: value for key, value in data.items() if key.startswith(last + ".")}
            assert data_bytes({**after, **back}) > budget


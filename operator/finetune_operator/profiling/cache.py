"""The profile cache: measurements per (config hash, setup) in one ConfigMap the operator owns.

The ConfigMap `finetune-operator-profiles` lives in the operator's namespace. Each key is
`<config hash>.<hash of the setup key>` (ConfigMap keys allow only [-._a-zA-Z0-9]) and holds a
ProfileMeasurement as JSON; `<config hash>.model` holds the model's shape and parameter counts.
A model is profiled once per setup, whichever job asks. Reading and writing it is the shell's
(shell/profiling.py); this module encodes, decodes and chooses what to evict.

The API server refuses a ConfigMap whose values pass 1 MiB, and a job's grid of 16 setups takes
about 3.8 KB, so the cache is bounded: `<config hash>.written` holds when the model's entries were last
written, and a write that would take the data past CACHE_BUDGET_BYTES first deletes whole models,
least recently written first (evictions). An evicted model is profiled again when a job needs it.

The cache is shared by every tenant, so it holds only figures the platform's own trainer image
measured (the config hash is taken with the image, `setups.config_hash`) and only plausible ones:
a measurement whose peak is below the size of the weights it trained (`implausible`) is refused,
logged, neither written nor read.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from typing import Mapping

from pydantic import ValidationError

from finetune_trainer.contract import ProfileMeasurement, ProfileReport, ProfileSetup

CACHE_CONFIGMAP = "finetune-operator-profiles"
log = logging.getLogger("finetune_operator.profiling")


def weights_bytes(total_params: int, setup: ProfileSetup) -> int:
    """What the weights alone take on one GPU of the setup: fp32 for full fine-tuning (the plain step
    the profile traces) and for fp32 precision, else the bf16 base; FSDP shards them over the GPUs."""
    per_param = 4 if setup.method == "full" or setup.precision == "fp32" else 2
    total = per_param * total_params
    return total // setup.world_size if setup.strategy == "fsdp" else total


def implausible(measurement: ProfileMeasurement, setup: ProfileSetup, total_params: int) -> str | None:
    """Why a measurement cannot be true (its peak is below the weights' own size); None when it can."""
    peak = max(measurement.peaks.values(), default=0)
    floor = weights_bytes(total_params, setup)
    if peak < floor:
        return (f"setup {setup.key}: a peak of {peak} bytes is below the {floor} bytes of the weights "
                f"({total_params} parameters)")
    return None


def setup_entry(config_hash: str, setup_key: str) -> str:
    return f"{config_hash}.{hashlib.sha256(setup_key.encode()).hexdigest()[:16]}"


def model_entry(config_hash: str) -> str:
    return f"{config_hash}.model"


def written_entry(config_hash: str) -> str:
    return f"{config_hash}.written"


# The API server's limit on a ConfigMap's values is 1 MiB; the rest is headroom for writers that
# evict from an older read (data_bytes counts the keys too).
CACHE_BUDGET_BYTES = 768 * 1024


@dataclass(frozen=True)
class CachedProfile:
    """What the cache holds for one model and the setups a job needs."""

    model: ProfileReport | None  # shape and params (measurements empty), None when never profiled
    measurements: dict[str, ProfileMeasurement]  # by setup key
    missing: list[ProfileSetup]


def read_cache(data: Mapping[str, str] | None, config_hash: str, setups: list[ProfileSetup]) -> CachedProfile:
    data = data or {}
    model = None
    text = data.get(model_entry(config_hash))
    if text:
        try:
            model = ProfileReport.model_validate_json(text)
        except (ValidationError, ValueError):
            model = None  # unreadable: profiled again, and overwritten
    found: dict[str, ProfileMeasurement] = {}
    missing: list[ProfileSetup] = []
    total = model.params.get("total", 0) if model is not None and model.ok else 0
    for setup in setups:
        raw = data.get(setup_entry(config_hash, setup.key))
        measurement = None
        if raw:
            try:
                measurement = ProfileMeasurement.model_validate_json(raw)
            except (ValidationError, ValueError):
                measurement = None
        why = implausible(measurement, setup, total) if measurement is not None else None
        if why is not None:
            log.warning("profile cache entry of config %s refused: %s", config_hash, why)
            measurement = None
        if measurement is not None and measurement.key == setup.key:
            found[setup.key] = measurement
        else:
            missing.append(setup)
    return CachedProfile(model if model is not None and model.ok else None, found, missing)


def refused_measurements(report: ProfileReport, setups: list[ProfileSetup]) -> dict[str, str]:
    """The report's measurements that are not plausible, by setup key, with why (`implausible`)."""
    by_key = {setup.key: setup for setup in setups}
    total = report.params.get("total", 0)
    refused = {}
    for m in report.measurements:
        why = implausible(m, by_key[m.key], total) if m.key in by_key else f"setup {m.key} was not asked for"
        if why is not None:
            refused[m.key] = why
    return refused


def cache_entries(config_hash: str, report: ProfileReport, written_at: str,
                  setups: list[ProfileSetup]) -> dict[str, str]:
    """The ConfigMap keys a successful report adds; `written_at` (RFC 3339, UTC) orders evictions.
    Measurements that are not plausible for `setups` are left out and logged."""
    if not report.ok:
        return {}
    refused = refused_measurements(report, setups)
    for why in refused.values():
        log.warning("profile of config %s: measurement refused, not cached: %s", config_hash, why)
    entries = {model_entry(config_hash): report.model_copy(update={"measurements": []})
               .model_dump_json(by_alias=True, exclude_none=True),
               written_entry(config_hash): written_at}
    for m in report.measurements:
        if m.key in refused:
            continue
        entries[setup_entry(config_hash, m.key)] = m.model_dump_json(by_alias=True, exclude_none=True)
    return entries


def as_report(cached: CachedProfile) -> ProfileReport | None:
    if cached.model is None:
        return None
    return cached.model.model_copy(update={"measurements": list(cached.measurements.values())})



def data_bytes(data: Mapping[str, str]) -> int:
    """Every key's and value's bytes: a little more than the API server counts against a ConfigMap's
    limit (the values), so a budget in these bytes keeps under it."""
    return sum(len(key.encode()) + len(value.encode()) for key, value in data.items())


def evictions(data: Mapping[str, str], entries: Mapping[str, str],
              budget: int = CACHE_BUDGET_BYTES) -> dict[str, None]:
    """The keys to delete (as merge-patch nulls) so that `data` with `entries` written fits `budget`:
    whole models, least recently written first (a model without a `.written` key first of all),
    never a model `entries` writes. Empty when it fits already."""
    after = {**data, **entries}
    size = data_bytes(after)
    if size <= budget:
        return {}
    writing = {key.split(".", 1)[0] for key in entries}
    models: dict[str, list[str]] = {}
    for key in after:
        digest = key.split(".", 1)[0]
        if digest not in writing:
            models.setdefault(digest, []).append(key)
    oldest_first = sorted(models, key=lambda digest: (after.get(written_entry(digest), ""), digest))
    evicted: dict[str, None] = {}
    for digest in oldest_first:
        if size <= budget:
            break
        for key in models[digest]:
            evicted[key] = None
            size -= len(key.encode()) + len(after[key].encode())
    return evicted


__all__ = ["CACHE_BUDGET_BYTES", "CACHE_CONFIGMAP", "CachedProfile", "as_report", "cache_entries", "data_bytes",
           "evictions", "implausible", "read_cache", "refused_measurements", "weights_bytes", "written_entry"]

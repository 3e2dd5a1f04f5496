"""The profile cache: measurements per (config hash, setup) in one ConfigMap the operator owns.

The ConfigMap `finetune-operator-profiles` lives in the operator's namespace. Each key is
`<config hash>.<hash of the setup key>` (ConfigMap keys allow only [-._a-zA-Z0-9]) and holds a
ProfileMeasurement as JSON; `<config hash>.model` holds the model's shape and parameter counts.
A model is profiled once per setup, whichever job asks. Reading and writing it is the shell's
(controller.py); this module only encodes and decodes.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Mapping

from pydantic import ValidationError

from finetune_trainer.contract import ProfileMeasurement, ProfileReport, ProfileSetup

CACHE_CONFIGMAP = "finetune-operator-profiles"


def setup_entry(config_hash: str, setup_key: str) -> str:
    return f"{config_hash}.{hashlib.sha256(setup_key.encode()).hexdigest()[:16]}"


def model_entry(config_hash: str) -> str:
    return f"{config_hash}.model"


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
    for setup in setups:
        raw = data.get(setup_entry(config_hash, setup.key))
        measurement = None
        if raw:
            try:
                measurement = ProfileMeasurement.model_validate_json(raw)
            except (ValidationError, ValueError):
                measurement = None
        if measurement is not None and measurement.key == setup.key:
            found[setup.key] = measurement
        else:
            missing.append(setup)
    return CachedProfile(model if model is not None and model.ok else None, found, missing)


def cache_entries(config_hash: str, report: ProfileReport) -> dict[str, str]:
    """The ConfigMap keys a successful report adds."""
    if not report.ok:
        return {}
    entries = {model_entry(config_hash): report.model_copy(update={"measurements": []})
               .model_dump_json(by_alias=True, exclude_none=True)}
    for m in report.measurements:
        entries[setup_entry(config_hash, m.key)] = m.model_dump_json(by_alias=True, exclude_none=True)
    return entries


def as_report(cached: CachedProfile) -> ProfileReport | None:
    if cached.model is None:
        return None
    return cached.model.model_copy(update={"measurements": list(cached.measurements.values())})


__all__ = ["CACHE_CONFIGMAP", "CachedProfile", "as_report", "cache_entries", "read_cache"]

"""Paths of the repository that several fast tests read."""

from __future__ import annotations

from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"


def example_jobs() -> list[Path]:
    """Every FineTuneJob YAML in examples/ (the pool catalogs there are not jobs)."""
    paths = []
    for path in sorted(EXAMPLES.glob("*.yaml")):
        docs = list(yaml.safe_load_all(path.read_text()))
        if any(isinstance(d, dict) and d.get("kind") == "FineTuneJob" for d in docs):
            paths.append(path)
    return paths

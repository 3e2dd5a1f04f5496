"""Shared fixtures of the fast tests (no cluster)."""

from __future__ import annotations

import copy
from typing import Any

import pytest


@pytest.fixture
def lora_job() -> dict[str, Any]:
    """A small valid job as a plain document, for tests to break one field at a time."""
    return copy.deepcopy(
        {
            "apiVersion": "finetune.dev/v1alpha1",
            "kind": "FineTuneJob",
            "metadata": {"name": "demo", "namespace": "team-a"},
            "spec": {
                "model": {
                    "name": "meta-llama/Llama-3.1-8B-Instruct",
                    "architecture": {"preset": "llama-3.1-8b"},
                    "source": {"pvc": {"claimName": "models", "path": "llama"}},
                },
                "dataset": {"source": {"pvc": {"claimName": "data", "path": "train.jsonl"}}},
                "method": "lora",
                "lora": {"rank": 16},
                "training": {"sequenceLength": 2048, "globalBatchSize": 32, "maxSteps": 100},
                "placement": {"regions": ["eu-de-berlin"]},
            },
        }
    )

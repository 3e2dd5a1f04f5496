"""Fixtures of the chart tests (see chart_support.py for where helm comes from)."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from chart_support import CHART, TOOLS_DIR, Helm, find_helm, required


@pytest.fixture(scope="session")
def helm(tmp_path_factory) -> Helm:
    binary = find_helm()
    if binary is None:
        msg = (
            "helm is not built: run `make lab-build` (builds the lab's pinned helm) or "
            f"`GOBIN={TOOLS_DIR} go install helm.sh/helm/v3/cmd/helm@<HELM_VERSION of e2e/lab/versions.env>`"
        )
        if required():
            pytest.fail(f"FINETUNE_LAB_REQUIRED=1 but {msg}", pytrace=False)
        pytest.skip(msg)
    return Helm(binary, tmp_path_factory.mktemp("helm-home"))


@pytest.fixture(scope="session")
def default_values() -> dict[str, Any]:
    return yaml.safe_load((CHART / "values.yaml").read_text())

"""Without helm the chart tests skip, except under FINETUNE_LAB_REQUIRED=1 (`make test`, CI), where a
missing helm must fail the run instead of hiding it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
A_HELM_TEST = "tests/chart/test_chart_render.py::test_default_objects"


def _run_without_helm(tmp_path: Path, required: bool) -> subprocess.CompletedProcess:
    env = {
        "PATH": str(Path(sys.executable).parent) + os.pathsep + "/usr/bin:/bin",
        "HOME": str(tmp_path),  # no ~/.cache/finetune-operator/tools/helm
        "FINETUNE_LAB_CACHE": str(tmp_path / "lab-cache"),  # no lab build
        "GOTOOLCHAIN": "local",
    }
    if required:
        env["FINETUNE_LAB_REQUIRED"] = "1"
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfs", A_HELM_TEST],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
    )


@pytest.mark.slow
@pytest.mark.skipif(Path("/usr/bin/helm").exists() or Path("/bin/helm").exists(), reason="a system helm is on PATH")
@pytest.mark.parametrize("required", [False, True])
def test_missing_helm_skips_or_fails(tmp_path, required):
    proc = _run_without_helm(tmp_path, required)
    out = proc.stdout + proc.stderr
    if required:
        assert proc.returncode == 1, out
        assert "FINETUNE_LAB_REQUIRED=1 but helm is not built" in out, out
    else:
        assert proc.returncode == 0, out
        assert "1 skipped" in out and "helm is not built" in out, out

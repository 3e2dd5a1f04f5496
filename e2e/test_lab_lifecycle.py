"""The lab's own lifecycle through its command line: up, status, down leaves nothing running.

Runs a second lab next to the session's, which also shows two labs do not interfere."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from e2e.lab import components as lab_components
from e2e.lab.cluster import Lab
from e2e.lab.processes import is_alive

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

REPO_ROOT = Path(__file__).resolve().parents[1]


def _cli(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "e2e.lab", *args], cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})


def _listening(lab: Lab) -> set[int]:
    """The ports the lab's processes listen on. An optional component's ports are reserved at `up`
    whether it starts or not, so a second lab may pick one that the first reserved and never used."""
    return {port for name, port in lab.ports.items() if lab.components or name not in lab_components.PORTS}


def test_up_status_down_leaves_nothing_running(lab, tmp_path):
    workdir = tmp_path / "second-lab"
    up = _cli("up", "--workdir", str(workdir))
    assert up.returncode == 0, up.stderr[-3000:]
    assert f"export KUBECONFIG={workdir}/admin.kubeconfig" in up.stdout
    second = Lab.load(workdir)
    try:
        assert _listening(second).isdisjoint(_listening(lab))
        status = _cli("status", "--workdir", str(workdir))
        assert status.returncode == 0 and "STOPPED" not in status.stdout, status.stdout
        nodes = json.loads(second.kubectl("get", "nodes", "-o", "json").stdout)["items"]
        assert len(nodes) == len(json.loads(lab.kubectl("get", "nodes", "-o", "json").stdout)["items"])
    finally:
        down = _cli("down", "--workdir", str(workdir))
    assert down.returncode == 0, down.stderr
    assert not [p.name for p in second.procs if is_alive(p)]
    assert not workdir.exists()
    # The session's lab is untouched.
    assert all(lab.status().values())
    lab.kubectl("get", "--raw", "/readyz")

"""A third-party policy scanner on what the operator deploys: checkov (PyPI, offline) on the chart's
rendered manifests and on the pods rendered for the examples (both backends, init, upload and profile
pods; tests/rendering/example_pods.py). Every finding left is skipped in the rendered object itself,
with checkov's inline form `checkov.io/skip<N>: CKV_...=<reason>`, and the reason is never empty.

    checkov -d <dir> --framework kubernetes -o json --compact --skip-download

Measured with checkov 3.3.30 before the hardening of issue 26 (the same 13 pods rendered by main):
chart 121 passed / 5 failed; pods 1052 passed / 105 failed in 9 kinds (CKV_K8S_38 token mounted,
CKV_K8S_22 writable root, CKV2_K8S_6 no NetworkPolicy, probes, digests, pull policy, uid, secrets in
env). After: chart 121 passed / 0 failed / 5 skipped; pods 1073 passed / 0 failed / 84 skipped, the
skips being rendering/pod.py SCANNER_SKIPS and the chart's finetune-operator.scannerSkips.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from chart_support import CHART, kubernetes_version

sys.path.append(str(Path(__file__).resolve().parents[1] / "rendering"))
from example_pods import example_network_policies, example_pods  # noqa: E402


def _checkov() -> str:
    """$CHECKOV (`make test` points it at the virtualenv `make install` made: it must be there), else
    one on PATH; a plain pytest run without either skips, saying how to get it."""
    named = os.environ.get("CHECKOV")
    if named:
        assert Path(named).is_file(), f"CHECKOV={named} does not exist: run `make install`"
        return named
    found = shutil.which("checkov")
    if not found:
        pytest.skip("checkov is not installed: `make install` puts it in .venv-checkov/ (point $CHECKOV at "
                    "its bin/checkov), or `pip install checkov` in a virtualenv of its own")
    return found


def _scan(checkov: str, folder: Path) -> dict:
    done = subprocess.run([checkov, "-d", str(folder), "--framework", "kubernetes", "-o", "json",
                           "--compact", "--skip-download"], capture_output=True, text=True, timeout=600)
    assert done.stdout.strip(), done.stderr[-3000:]
    report = json.loads(done.stdout)
    return report[0] if isinstance(report, list) else report


def test_checkov_finds_nothing_unexplained_in_the_chart_and_the_pods(helm, tmp_path):
    checkov = _checkov()
    chart = helm.run("template", "ft", str(CHART), "--namespace", "finetune-system", "--kube-version",
                     kubernetes_version(), "--set", "trainJobRuntime.enabled=true", check=True).stdout
    (tmp_path / "chart.yaml").write_text(chart)
    pods = example_pods()
    (tmp_path / "pods.yaml").write_text(yaml.safe_dump_all(pods, sort_keys=False))
    # The attempts' NetworkPolicies beside their pods: CKV2_K8S_6 finds the policy that selects each.
    (tmp_path / "network-policies.yaml").write_text(yaml.safe_dump_all(example_network_policies(), sort_keys=False))
    report = _scan(checkov, tmp_path)
    summary = report["summary"]
    failed = [(f["check_id"], f["resource"]) for f in report["results"]["failed_checks"]]
    assert failed == [], failed
    assert summary["parsing_errors"] == 0 and summary["resource_count"] >= len(pods) + 10
    assert summary["passed"] > 1000
    for skipped in report["results"]["skipped_checks"]:
        reason = (skipped.get("check_result") or {}).get("suppress_comment") or ""
        assert len(reason.strip()) > 20, skipped["check_id"]
    # Hardening that must hold, not be skipped: token, read-only root, non-root, capabilities.
    never_skipped = {"CKV_K8S_38", "CKV_K8S_22", "CKV_K8S_23", "CKV_K8S_37", "CKV_K8S_20", "CKV_K8S_28"}
    on_pods = [s["check_id"] for s in report["results"]["skipped_checks"] if "finetune-operator" not in s["resource"]]
    assert never_skipped.isdisjoint(on_pods), sorted(never_skipped & set(on_pods))

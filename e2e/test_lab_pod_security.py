"""The lab's real kube-apiserver, whose PodSecurity admission enforces the restricted standard in a
namespace labelled so, admits every pod the operator makes for the examples: training pods on both
backends, the init containers that fetch, the master that uploads, and the profile pod (server-side
dry-run creates; tests/rendering/example_pods.py builds them). A pod without the hardening is refused
in the same namespace, so the namespace does enforce."""

from __future__ import annotations

import json
import sys
import uuid
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.append(str(REPO / "tests" / "rendering"))

from example_pods import example_pods  # noqa: E402

pytestmark = pytest.mark.e2e


@pytest.fixture
def restricted(lab):
    name = f"restricted-{uuid.uuid4().hex[:6]}"
    lab.kubectl("create", "namespace", name)
    lab.kubectl("label", "namespace", name, "pod-security.kubernetes.io/enforce=restricted",
                "pod-security.kubernetes.io/enforce-version=latest")
    yield name
    lab.kubectl("delete", "namespace", name, "--wait=false", check=False)


def _dry_run(lab, pod: dict) -> tuple[int, str]:
    done = lab.kubectl("create", "--dry-run=server", "-o", "name", "-f", "-", input=json.dumps(pod), check=False)
    return done.returncode, done.stdout + done.stderr


def test_the_restricted_standard_admits_every_pod_the_operator_makes(lab, restricted):
    pods = example_pods(restricted)
    refused = {}
    for pod in pods:
        code, out = _dry_run(lab, pod)
        if code != 0:
            refused[pod["metadata"]["name"]] = out.strip()
    assert refused == {}
    assert len(pods) >= 10

    # The control: the same pod with a writable root, the token mounted and root allowed is refused.
    loose = json.loads(json.dumps(pods[0]))
    loose["metadata"]["name"] = "loose"
    loose["spec"].pop("automountServiceAccountToken")
    for container in loose["spec"]["containers"]:
        container["securityContext"] = {}
    loose["spec"]["securityContext"] = {}
    code, out = _dry_run(lab, loose)
    assert code != 0 and "violates PodSecurity" in out and "restricted" in out, out

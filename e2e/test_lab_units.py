"""Fast tests of the lab's pure parts (no cluster, no binaries)."""

from __future__ import annotations

import ipaddress
import json
import subprocess

import pytest
import yaml
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.hazmat.primitives.serialization import load_pem_private_key

from e2e.lab import fate, toolsmod
from e2e.lab.build import check_tools_module, BuildError
from e2e.lab.cluster import LAB_STAGES
from e2e.lab.nodes import DEFAULT_ALLOWED_REGIONS, GPU_RESOURCE, all_node_manifests, load_pools
from e2e.lab.pki import WEBHOOK_CA_NAME, WEBHOOK_DNS_NAME, make_lab_pki
from e2e.lab.versions import TOOLS_DIR, VersionsError, load_versions, parse_versions
from finetune_trainer.contract import EXIT_GPU_OOM, FailureReason, FailureReport

GOOD = """
KUBERNETES_VERSION=v1.36.3
ETCD_VERSION=v3.6.8
KWOK_VERSION=v0.8.0
TRAINING_OPERATOR_VERSION=v1.9.3
HELM_VERSION=v3.22.0
"""


# ---- versions and the tools module ------------------------------------------------------------
def test_versions_parse_and_staging_version():
    v = parse_versions(GOOD)
    assert v.kubernetes == "v1.36.3" and v.staging == "v0.36.3"


@pytest.mark.parametrize("text, needle", [
    (GOOD.replace("v0.8.0", "0.8"), "KWOK_VERSION='0.8'"),
    (GOOD.replace("HELM_VERSION=v3.22.0", ""), "missing HELM_VERSION"),
    (GOOD + "CUDA_VERSION=v12.0.0\n", "unknown key 'CUDA_VERSION'"),
    (GOOD + "garbage\n", "expected KEY=VALUE"),
])
def test_versions_errors_name_the_key(text, needle):
    with pytest.raises(VersionsError, match=None) as err:
        parse_versions(text)
    assert needle in str(err.value)


def test_cache_key_changes_with_any_version():
    a = parse_versions(GOOD)
    b = parse_versions(GOOD.replace("v0.8.0", "v0.7.0"))
    assert a.cache_key() != b.cache_key()


def test_committed_tools_module_matches_versions_env():
    check_tools_module(load_versions())  # raises BuildError naming both sides on drift
    go_mod = (TOOLS_DIR / "go.mod").read_text()
    for cmd in toolsmod.KUBERNETES_COMMANDS + (toolsmod.ETCD_COMMAND,) + toolsmod.NODE_COMMANDS:
        assert f"tool {cmd}\n" in go_mod


def test_tools_module_drift_is_reported():
    v = parse_versions(GOOD.replace("v1.36.3", "v1.37.2"))
    with pytest.raises(BuildError, match="sync-tools"):
        check_tools_module(v)


def test_staging_modules_come_from_kubernetes_go_mod():
    go_mod = """module k8s.io/kubernetes
require (
\tk8s.io/api v0.0.0
\tk8s.io/client-go v0.0.0
\tgithub.com/x/y v1.2.3
)
replace (
\tk8s.io/api => ./staging/src/k8s.io/api
\tk8s.io/client-go => ./staging/src/k8s.io/client-go
\tk8s.io/sample-cli-plugin => ./staging/src/k8s.io/sample-cli-plugin
)
"""
    assert toolsmod.staging_modules(go_mod) == ["k8s.io/api", "k8s.io/client-go"]
    rendered = toolsmod.render_go_mod(parse_versions(GOOD), ["k8s.io/api"], "1.26.0")
    assert "k8s.io/api => k8s.io/api v0.36.3" in rendered
    assert toolsmod.declared_versions(rendered)["k8s.io/kubernetes"] == "v1.36.3"


# ---- nodes ---------------------------------------------------------------------------------------
def test_pools_cover_allowed_and_forbidden_regions():
    catalog = load_pools()
    regions = {p.region for p in catalog.gpu_pools()}
    assert set(DEFAULT_ALLOWED_REGIONS) <= regions
    assert regions - set(DEFAULT_ALLOWED_REGIONS), "need a GPU region outside the default policy"


def test_gpu_node_manifest_looks_like_a_gfd_labelled_node():
    nodes = {n["metadata"]["name"]: n for n in all_node_manifests()}
    h100 = nodes["h100-berlin-0"]
    assert h100["metadata"]["labels"]["nvidia.com/gpu.memory"] == "81559"
    assert h100["status"]["capacity"][GPU_RESOURCE] == "8"
    assert h100["spec"]["taints"][0]["key"] == GPU_RESOURCE
    assert nodes["h100-berlin-1"]["metadata"]["labels"]["topology.kubernetes.io/zone"] == "eu-de-berlin-1b"
    assert GPU_RESOURCE not in nodes["system-berlin-0"]["status"]["capacity"]


# ---- the fake GPU's decision ---------------------------------------------------------------------
GIB = fate.GIB


def _rule(**values):
    return fate.resolve_rule([fate.RuleSource("pod ns/p", {k.replace("_", "-"): v for k, v in values.items()})])


def test_true_peak_over_capacity_is_a_gpu_oom_with_a_valid_report():
    v = fate.decide(fate.TrainingPod("ns/p", 75 * GIB, 81559, rank=2), _rule(true_peak_factor="1.15"))
    assert v.exit_code == EXIT_GPU_OOM and v.pod_phase == "Failed"
    report = FailureReport.model_validate_json(v.termination_message)
    assert report.reason is FailureReason.GPU_OUT_OF_MEMORY and report.rank == 2
    assert report.exit_code == EXIT_GPU_OOM
    assert report.device_total_bytes == 81559 * fate.MIB
    assert report.peak_allocated_bytes < report.device_total_bytes
    assert json.loads(v.termination_message)["peakAllocatedBytes"] == report.peak_allocated_bytes


def test_true_peak_under_capacity_succeeds():
    v = fate.decide(fate.TrainingPod("ns/p", 60 * GIB, 81559), _rule(true_peak_factor="1.15"))
    assert (v.exit_code, v.container_reason, v.pod_phase) == (0, "Completed", "Succeeded")


def test_boundary_exactly_full_fits():
    cap = 40960
    assert fate.decide(fate.TrainingPod("p", cap * fate.MIB, cap), fate.Rule()).exit_code == 0
    assert fate.decide(fate.TrainingPod("p", cap * fate.MIB + 1, cap), fate.Rule()).exit_code == EXIT_GPU_OOM


def test_forced_outcomes():
    pod = fate.TrainingPod("p", 1 * GIB, 81559)
    host = fate.decide(pod, _rule(outcome="host-oom"))
    assert (host.exit_code, host.container_reason, host.termination_message) == (137, "OOMKilled", "")
    fail = fate.decide(pod, _rule(outcome="fail", fail_message="boom", fail_exit_code="3"))
    assert (fail.exit_code, fail.termination_message) == (3, "boom")
    assert fate.decide(pod, _rule(outcome="gpu-oom")).exit_code == EXIT_GPU_OOM
    assert fate.decide(fate.TrainingPod("p", 500 * GIB, 81559), _rule(outcome="succeed")).exit_code == 0


def test_rule_precedence_is_key_by_key():
    rule = fate.resolve_rule([
        fate.RuleSource("pod", {"outcome": "succeed"}),
        fate.RuleSource("FineTuneJob", {"outcome": "fail", "true-peak-factor": "2"}),
        fate.RuleSource("ConfigMap", {"true-peak-factor": "3", "run-duration": "5s"}),
    ])
    assert (rule.outcome, rule.true_peak_factor, rule.run_duration) == ("succeed", 2.0, "5s")


@pytest.mark.parametrize("key, value", [
    ("true-peak-factor", "lots"), ("true-peak-factor", "-1"), ("true-peak-factor", "nan"),
    ("outcome", "explode"), ("fail-exit-code", "0"), ("run-duration", "soon"), ("oom-phase", "lunch"),
])
def test_bad_rule_values_name_key_and_source(key, value):
    with pytest.raises(fate.RuleError) as err:
        fate.resolve_rule([fate.RuleSource("FineTuneJob team-a/x", {key: value})])
    assert f"lab.finetune.dev/{key}={value!r} on FineTuneJob team-a/x" in str(err.value)


def test_missing_inputs_fail_loudly():
    assert "no finetune.dev/predicted-peak-bytes" in fate.decide(fate.TrainingPod("p", None, 81559), fate.Rule()).termination_message
    assert "without the nvidia.com/gpu.memory" in fate.decide(fate.TrainingPod("p", GIB, None), fate.Rule()).termination_message
    with pytest.raises(fate.RuleError, match="predicted-peak-bytes='1e9'"):
        fate.parse_predicted_peak("1e9")


def test_rank_follows_kubeflow_convention():
    assert fate.rank_of({"training.kubeflow.org/replica-type": "master", "training.kubeflow.org/replica-index": "0"}) == 0
    assert fate.rank_of({"training.kubeflow.org/replica-type": "worker", "training.kubeflow.org/replica-index": "2"}) == 3
    assert fate.rank_of(None) == 0


def test_verdict_annotations_match_the_kwok_stage():
    stage = yaml.safe_load(LAB_STAGES.read_text())
    template = stage["spec"]["next"]["statusTemplate"]
    for key in (fate.VERDICT_EXIT_CODE, fate.VERDICT_REASON, fate.VERDICT_MESSAGE, fate.VERDICT_PHASE):
        assert f'"{key}"' in template
    exprs = [e["key"] for e in stage["spec"]["selector"]["matchExpressions"]]
    assert f'.metadata.annotations["{fate.VERDICT_EXIT_CODE}"]' in exprs
    assert fate.VERDICT_DELAY in stage["spec"]["delay"]["durationFrom"]["expressionFrom"]


# ---- certificates --------------------------------------------------------------------------------
def test_pki_certs_fit_their_consumers(tmp_path):
    pki = make_lab_pki(tmp_path, "10.96.0.1")
    api = x509.load_pem_x509_certificate(pki.apiserver.cert_pem())
    sans = api.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert ipaddress.ip_address("127.0.0.1") in sans.get_values_for_type(x509.IPAddress)
    admin = x509.load_pem_x509_certificate(pki.clients["admin"].cert_pem())
    assert "system:masters" in admin.subject.rfc4514_string()
    # The training operator's cert rotator parses the CA key as PKCS#1 RSA and checks names.
    assert pki.webhook_ca.key_pem().startswith(b"-----BEGIN RSA PRIVATE KEY-----")
    assert isinstance(load_pem_private_key(pki.webhook_ca.key_pem(), None), rsa.RSAPrivateKey)
    ca = x509.load_pem_x509_certificate(pki.webhook_ca.cert_pem())
    assert ca.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(x509.DNSName) == [WEBHOOK_CA_NAME]
    hook = x509.load_pem_x509_certificate(pki.webhook_server.cert_pem())
    hook_sans = hook.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert WEBHOOK_DNS_NAME in hook_sans.get_values_for_type(x509.DNSName)
    assert ipaddress.ip_address("127.0.0.1") in hook_sans.get_values_for_type(x509.IPAddress)
    # The operator's rotator replaces certs that expire within 90 days.
    assert (hook.not_valid_after_utc - hook.not_valid_before_utc).days > 365
    assert (ca.not_valid_after_utc - ca.not_valid_before_utc).days > 365
    verify = subprocess.run(["openssl", "verify", "-CAfile", str(pki.webhook_ca.cert), str(pki.webhook_server.cert)],
                            capture_output=True, text=True)
    assert verify.returncode == 0, verify.stderr

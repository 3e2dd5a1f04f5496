"""Object storage on the lab (issue 18 item 11): a FineTuneJob whose data and output live in a real
S3-compatible server (rclone `serve s3`, e2e/lab/objectstore.py) runs to Succeeded, in the region
the policy says the storage may be used from; endpoints the policy refuses make the job Invalid;
uri sources are refused by the API server.

The fake GPU ends the training pods by rule, so the init container and the upload step do not run
inside the lab. What they would run is checked against the real server instead: the rendered
commands are executed here with the environment their secretKeyRefs resolve to (read from the
Secret through the API), so the rendered manifest, the Secret and the trainer's objectstore
module are tested together.

The tests without the e2e mark (the version pin agreeing with s3server/go.mod) run everywhere.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from e2e import operator_harness as h
from e2e.lab import build as lab_build
from e2e.lab.versions import load_versions

REPO = Path(__file__).resolve().parents[1]
SECRET = "s3-team-a"
BUCKET = "team-a"
# An endpoint the policy lists in a region this job may not use (no server behind it: never reached).
VIRGINIA = "https://s3.us-east-virginia.example"


def test_the_s3_server_module_pins_the_version_of_versions_env():
    v = load_versions()
    assert v.rclone, "versions.env pins RCLONE_VERSION"
    lab_build.check_s3_module(v)
    go_mod = (lab_build.S3_MODULE_DIR / "go.mod").read_text()
    assert f"require github.com/rclone/rclone {v.rclone}\n" in go_mod
    # Pinning the S3 server never changes the Kubernetes binaries' cache key.
    assert v.cache_key() == load_versions().__class__(**{**v.__dict__, "rclone": "v9.9.9"}).cache_key()


@pytest.fixture(scope="module")
def s3(lab, tmp_path_factory):
    from e2e.lab.objectstore import server

    running = server(tmp_path_factory.mktemp("s3"))
    if running is None:
        message = "the lab's S3 server is not built (python -m e2e.lab build)"
        if os.environ.get("FINETUNE_LAB_REQUIRED", "") not in ("", "0", "false", "no"):
            pytest.fail(f"FINETUNE_LAB_REQUIRED=1 but {message}", pytrace=False)
        pytest.skip(message)
    running.start()
    running.make_bucket(BUCKET)
    yield running
    running.stop()


@pytest.fixture(scope="module")
def operator(lab, ftj_crd, s3, tmp_path_factory):
    """The chart with a policy whose objectStorage lists the lab's server in Paris, and Virginia's."""
    storage = [{"endpoint": s3.endpoint, "region": "eu-fr-paris"}, {"endpoint": VIRGINIA, "region": "us-east-virginia"}]
    h.install_chart(lab, "--set-json", f"policy.objectStorage={json.dumps(storage)}")
    with h.running_operator(lab, tmp_path_factory.mktemp("operator-s3")) as process:
        yield process



def _secret(lab, namespace: str, s3) -> None:
    lab.kubectl("create", "secret", "generic", SECRET, "-n", namespace,
                f"--from-literal=accessKeyId={s3.access_key_id}", f"--from-literal=secretAccessKey={s3.secret_access_key}")


def _s3(endpoint: str, key: str) -> dict:
    return {"endpoint": endpoint, "bucket": BUCKET, "key": key, "credentialsSecretRef": {"name": SECRET}}


def _job(namespace: str, name: str, endpoint: str, *, regions: list[str], rule: dict | None = None) -> dict:
    job = h.job_from_example("llama-8b-lora.yaml", name, namespace, rule=rule or {"outcome": "succeed", "run-duration": "1s"})
    job["spec"]["dataset"]["source"] = {"s3": _s3(endpoint, "support/train.jsonl")}
    job["spec"]["output"] = {"s3": _s3(endpoint, f"results/{name}/")}
    job["spec"]["placement"] = {"regions": regions}
    job["spec"]["resources"].pop("gpuTypes", None)
    return job


def _resolve_env(lab, namespace: str, env: list[dict]) -> dict[str, str]:
    """A container's environment as the kubelet would set it: secretKeyRefs read from the Secret."""
    resolved = {}
    for item in env:
        if "value" in item:
            resolved[item["name"]] = item["value"]
            continue
        ref = item["valueFrom"]["secretKeyRef"]
        secret = json.loads(lab.kubectl("get", "secret", ref["name"], "-n", namespace, "-o", "json").stdout)
        resolved[item["name"]] = base64.b64decode(secret["data"][ref["key"]]).decode()
    return resolved


def _here(command: list[str], env: dict[str, str], replace: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """A rendered container command for this machine: `python` is this interpreter, and the
    `--name=` arguments in `replace` point at local folders instead of the pod's volumes."""
    argv = [sys.executable if command[0] == "python" else command[0]]
    for arg in command[1:]:
        name = arg.split("=", 1)[0]
        argv.append(f"{name}={replace[name]}" if name in replace else arg)
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("FINETUNE_S3_")}
    full_env.update({k: v for k, v in env.items() if k.startswith("FINETUNE_S3_")})
    return argv, full_env


def _run_here(command: list[str], env: dict[str, str], replace: dict[str, str]) -> subprocess.CompletedProcess:
    argv, full_env = _here(command, env, replace)
    return subprocess.run(argv, env=full_env, capture_output=True, text=True, timeout=120, cwd=REPO)


def _start_here(command: list[str], env: dict[str, str], replace: dict[str, str]) -> subprocess.Popen:
    argv, full_env = _here(command, env, replace)
    return subprocess.Popen(argv, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)


@pytest.mark.e2e
def test_s3_data_and_output_run_where_the_storage_may_be_used(lab, operator, s3, namespace, tmp_path):
    start = time.monotonic()
    data = b'{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}\n'
    (s3.root / BUCKET / "support").mkdir(parents=True, exist_ok=True)
    (s3.root / BUCKET / "support" / "train.jsonl").write_bytes(data)
    _secret(lab, namespace, s3)
    # Berlin would be chosen without the storage (its H100 plan is the cheapest); the policy says the
    # lab's server keeps its data in Paris and may be used only from there.
    h.apply_job(lab, _job(namespace, "s3-happy", s3.endpoint, regions=["eu-de-berlin", "eu-fr-paris"]))
    lab.kubectl("wait", "--for=condition=Succeeded", "ftj/s3-happy", "-n", namespace, "--timeout=120s", timeout=130)
    done = h.get_job(lab, namespace, "s3-happy")
    assert done["status"]["phase"] == "Succeeded"
    assert done["status"]["plan"]["region"] == "eu-fr-paris", done["status"]["plan"]
    nodes = {n["metadata"]["name"]: n for n in json.loads(lab.kubectl("get", "nodes", "-o", "json").stdout)["items"]}
    pods = h.pods(lab, namespace, "s3-happy")
    assert pods and {nodes[p["spec"]["nodeName"]]["metadata"]["labels"]["topology.kubernetes.io/region"]
                     for p in pods} == {"eu-fr-paris"}

    # The pods as the API server stored them: the fetch init container, the upload sidecar, the Secret
    # refs in those two only (the training container holds no credential).
    spec = pods[0]["spec"]
    (fetch, sidecar) = spec["initContainers"]
    (trainer,) = spec["containers"]
    assert fetch["name"] == "fetch-data"
    assert fetch["command"][:4] == ["python", "-m", "finetune_trainer.objectstore", "fetch"]
    assert f"--endpoint={s3.endpoint}" in fetch["command"] and "--key=support/train.jsonl" in fetch["command"]
    assert sidecar["name"] == "upload" and sidecar["restartPolicy"] == "Always"
    assert sidecar["command"][:4] == ["python", "-m", "finetune_trainer.objectstore", "upload-sidecar"]
    assert trainer["command"][:4] == ["python", "-m", "finetune_trainer.objectstore", "train-and-hand-off"]
    for container in (fetch, sidecar):
        refs = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in container["env"] if e["name"].startswith("FINETUNE_S3_")}
        assert refs == {"FINETUNE_S3_ACCESS_KEY_ID": {"name": SECRET, "key": "accessKeyId"},
                        "FINETUNE_S3_SECRET_ACCESS_KEY": {"name": SECRET, "key": "secretAccessKey"}}
    assert not any("valueFrom" in e for e in trainer["env"]) and "envFrom" not in trainer
    manifests = json.dumps(pods) + lab.kubectl("get", "configmaps", "-n", namespace, "-o", "json").stdout
    assert s3.secret_access_key not in manifests and s3.access_key_id not in manifests
    config = json.loads(lab.kubectl("get", "configmap", done["status"]["attempts"][0]["pytorchJob"], "-n", namespace,
                                    "-o", "jsonpath={.data.config\\.json}").stdout)
    assert config["dataset"]["path"] == "/mnt/data/train.jsonl" and config["outputDirectory"] == "/mnt/output"

    # What the init container runs, run here against the real server with the Secret's values.
    fetched = tmp_path / "data"
    proc = _run_here(fetch["command"], _resolve_env(lab, namespace, fetch["env"]), {"--dest": str(fetched)})
    assert proc.returncode == 0, proc.stderr
    assert (fetched / "train.jsonl").read_bytes() == data
    # The upload sidecar, run here, with a result standing in for the trainer's and the training
    # container's request on the hand-off folder.
    result, handoff = tmp_path / "output", tmp_path / "handoff"
    (result / "adapter").mkdir(parents=True)
    handoff.mkdir()
    (result / "adapter" / "adapter_config.json").write_text('{"r": 16}')
    proc = _start_here(sidecar["command"], _resolve_env(lab, namespace, sidecar["env"]),
                       {"--source": str(result), "--handoff": str(handoff)})
    try:
        (handoff / "request").write_text("{}")
        deadline = time.monotonic() + 60
        while not (handoff / "result").exists():
            assert time.monotonic() < deadline and proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            time.sleep(0.2)
        assert json.loads((handoff / "result").read_text()) == {"files": 1, "failure": None}
    finally:
        proc.terminate()
        proc.communicate(timeout=30)
    assert (s3.root / BUCKET / "results" / "s3-happy" / "adapter" / "adapter_config.json").read_text() == '{"r": 16}'
    print(f"scenario s3 data and output: {h.elapsed(start)}")


@pytest.mark.e2e
@pytest.mark.parametrize("case", ["not-listed", "other-region"])
def test_an_endpoint_the_policy_refuses_makes_the_job_invalid(lab, operator, s3, namespace, case):
    start = time.monotonic()
    _secret(lab, namespace, s3)
    endpoint = "http://127.0.0.1:1" if case == "not-listed" else VIRGINIA
    h.apply_job(lab, _job(namespace, f"s3-{case}", endpoint, regions=["eu-de-berlin"]))
    failed = h.wait_phase(lab, namespace, f"s3-{case}", ("Failed",), timeout=60)
    validated = h.condition(failed, "Validated")
    assert validated["status"] == "False" and validated["reason"] == "Invalid"
    assert "spec.dataset.source.s3.endpoint" in validated["message"]
    if case == "other-region":
        assert "us-east-virginia" in validated["message"] and "eu-de-berlin" in validated["message"]
    else:
        assert "not an object storage endpoint the cluster policy allows" in validated["message"]
    assert h.pytorch_jobs(lab, namespace, f"s3-{case}") == []
    print(f"scenario s3 endpoint {case}: {h.elapsed(start)}")


@pytest.mark.e2e
def test_uri_sources_are_refused_by_the_api_server_as_not_supported(lab, ftj_crd, namespace):
    job = h.job_from_example("llama-8b-lora.yaml", "uri-data", namespace)
    job["spec"]["dataset"]["source"] = {"uri": "gs://bucket/train.jsonl"}
    proc = lab.kubectl("apply", "-f", "-", input=json.dumps(job), check=False)
    assert proc.returncode != 0
    assert "spec.dataset.source.uri" in proc.stderr and "not supported yet" in proc.stderr, proc.stderr

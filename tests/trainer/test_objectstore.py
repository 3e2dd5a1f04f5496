"""finetune_trainer.objectstore against a real S3-compatible server: the lab's rclone `serve s3`
(built by `python -m e2e.lab build` at RCLONE_VERSION), started on a loopback port for this module.

Skips when the server is not built; FINETUNE_LAB_REQUIRED=1 (CI, `make test`) makes that a failure.
Each test runs the module as the pods do (`python -m finetune_trainer.objectstore ...`, credentials
in the environment) or calls its functions with a client of the real server.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from finetune_trainer import contract, objectstore

REPO = Path(__file__).resolve().parents[2]
REQUIRED = os.environ.get("FINETUNE_LAB_REQUIRED", "") not in ("", "0", "false", "no")


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    try:
        from e2e.lab.objectstore import server
    except ImportError:  # e2e is importable when pytest runs from the repository root
        server = None
    running = server(tmp_path_factory.mktemp("s3")) if server is not None else None
    if running is None:
        message = "the lab's S3 server is not built (python -m e2e.lab build)"
        if REQUIRED:
            pytest.fail(f"FINETUNE_LAB_REQUIRED=1 but {message}", pytrace=False)
        pytest.skip(message)
    running.start()
    running.make_bucket("models")
    running.make_bucket("data")
    running.make_bucket("results")
    yield running
    running.stop()


def env_of(s3, **extra) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "FINETUNE_S3_"))}
    env.update({objectstore.ACCESS_KEY_ENV: s3.access_key_id, objectstore.SECRET_KEY_ENV: s3.secret_access_key})
    env.update(extra)
    return env


def run(s3, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "finetune_trainer.objectstore", *args], capture_output=True, text=True,
                          env=env if env is not None else env_of(s3), timeout=120, cwd=REPO)


def client(s3, secret: str | None = None):
    location = objectstore.Location(s3.endpoint, "models", "")
    return objectstore.client(location, objectstore.Credentials(s3.access_key_id, secret or s3.secret_access_key),
                              max_attempts=2, timeout=5)


def location_args(s3, bucket: str, key: str) -> list[str]:
    return [f"--endpoint={s3.endpoint}", f"--bucket={bucket}", f"--key={key}"]


def test_fetch_a_model_folder_keeps_its_layout(s3, tmp_path):
    files = {"llama/config.json": b'{"model_type": "llama"}', "llama/tokenizer/tokenizer.json": b"{}",
             "llama/model-00001-of-00002.safetensors": os.urandom(9 * 1024 * 1024),  # multipart upload
             "llama-other/config.json": b"not this one"}
    c = client(s3)
    for key, body in files.items():
        c.put_object(Bucket="models", Key=key, Body=body)
    dest = tmp_path / "model"
    proc = run(s3, "fetch", *location_args(s3, "models", "llama/"), f"--dest={dest}", "--phase=load")
    assert proc.returncode == 0, proc.stderr
    got = {p.relative_to(dest).as_posix(): p.read_bytes() for p in dest.rglob("*") if p.is_file()}
    assert got == {k.removeprefix("llama/"): v for k, v in files.items() if k.startswith("llama/")}


def test_fetch_one_data_object(s3, tmp_path):
    client(s3).put_object(Bucket="data", Key="support/train.jsonl", Body=b'{"text": "hi"}\n')
    proc = run(s3, "fetch", *location_args(s3, "data", "support/train.jsonl"), f"--dest={tmp_path}")
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "train.jsonl").read_bytes() == b'{"text": "hi"}\n'
    assert [p.name for p in tmp_path.iterdir()] == ["train.jsonl"]  # no partial files left behind


def _report(path: Path) -> contract.FailureReport:
    report = contract.parse_failure_report(path.read_text())
    assert report is not None, path.read_text()
    return report


@pytest.mark.parametrize(
    "bucket,key,says",
    [
        ("data", "support/missing.jsonl", "not found"),
        ("no-such-bucket", "x/", "NoSuchBucket"),
        ("data", "empty-prefix/", "no objects under"),
    ],
)
def test_missing_data_is_a_data_error_report(s3, tmp_path, bucket, key, says):
    report_path = tmp_path / "termination-log"
    proc = run(s3, "fetch", *location_args(s3, bucket, key), f"--dest={tmp_path / 'd'}", f"--report-path={report_path}")
    assert proc.returncode == contract.EXIT_DATA_ERROR, proc.stderr
    report = _report(report_path)
    assert report.reason is contract.FailureReason.DATA_ERROR and report.phase is contract.Phase.DATA
    assert says in report.message and s3.endpoint in report.message


def test_wrong_credentials_are_a_data_error_without_the_secret(s3, tmp_path):
    report_path = tmp_path / "termination-log"
    env = env_of(s3, **{objectstore.SECRET_KEY_ENV: "not-the-secret"})
    proc = run(s3, "fetch", *location_args(s3, "models", "llama/"), f"--dest={tmp_path / 'm'}", "--phase=load",
               f"--report-path={report_path}", env=env)
    assert proc.returncode == contract.EXIT_DATA_ERROR, proc.stderr
    report = _report(report_path)
    assert report.phase is contract.Phase.LOAD and "access denied" in report.message
    assert "not-the-secret" not in proc.stdout + proc.stderr + report_path.read_text()


def test_missing_credentials_are_a_config_error(s3, tmp_path):
    report_path = tmp_path / "termination-log"
    env = {k: v for k, v in env_of(s3).items() if k != objectstore.SECRET_KEY_ENV}
    proc = run(s3, "fetch", *location_args(s3, "models", "llama/"), f"--dest={tmp_path}", f"--report-path={report_path}",
               env=env)
    assert proc.returncode == contract.EXIT_CONFIG_ERROR
    assert objectstore.SECRET_KEY_ENV in _report(report_path).message


def test_an_unreachable_endpoint_is_unknown_not_a_data_error(s3, tmp_path):
    from e2e.lab.processes import free_port

    report_path = tmp_path / "termination-log"
    proc = run(s3, "fetch", f"--endpoint=http://127.0.0.1:{free_port()}", "--bucket=data", "--key=x.jsonl",
               f"--dest={tmp_path}", f"--report-path={report_path}", "--max-attempts=2")
    assert proc.returncode == contract.EXIT_UNKNOWN
    assert _report(report_path).reason is contract.FailureReason.UNKNOWN


def test_upload_a_result_folder(s3, tmp_path):
    result = tmp_path / "final"
    (result / "adapter").mkdir(parents=True)
    (result / "adapter" / "adapter_model.safetensors").write_bytes(os.urandom(12 * 1024 * 1024))
    (result / "adapter" / "adapter_config.json").write_text('{"r": 16}')
    proc = run(s3, "upload", *location_args(s3, "results", "support-bot"), f"--source={result}")
    assert proc.returncode == 0, proc.stderr
    listed = client(s3).list_objects_v2(Bucket="results", Prefix="support-bot/")["Contents"]
    assert sorted(o["Key"] for o in listed) == ["support-bot/adapter/adapter_config.json",
                                                 "support-bot/adapter/adapter_model.safetensors"]
    # What was uploaded fetches back byte for byte: the files are on the server's disk.
    assert (s3.root / "results" / "support-bot" / "adapter" / "adapter_config.json").read_text() == '{"r": 16}'


def test_upload_to_a_missing_bucket_is_a_data_error(s3, tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "x").write_text("x")
    report_path = tmp_path / "termination-log"
    proc = run(s3, "upload", *location_args(s3, "no-such-bucket", "out/"), f"--source={tmp_path / 'out'}",
               f"--report-path={report_path}")
    assert proc.returncode == contract.EXIT_DATA_ERROR, proc.stderr
    assert _report(report_path).phase is contract.Phase.CHECKPOINT


def test_keys_that_would_leave_the_destination_are_skipped(s3, tmp_path):
    c = client(s3)
    c.put_object(Bucket="models", Key="tricky/ok.json", Body=b"ok")
    assert objectstore._safe_relative("tricky/../../etc/passwd", "tricky/") is None
    assert objectstore._safe_relative("tricky//x", "tricky/") is None
    written = objectstore.fetch(c, objectstore.Location(s3.endpoint, "models", "tricky/"), tmp_path / "t")
    assert written == [tmp_path / "t" / "ok.json"]


def sidecar(s3, tmp_path, key: str, secret: str | None = None) -> tuple[subprocess.Popen, Path, Path]:
    """The upload sidecar as the pod runs it: its own process, the key pair in its environment only."""
    out, handoff = tmp_path / "output", tmp_path / "handoff"
    out.mkdir(exist_ok=True)
    handoff.mkdir(exist_ok=True)
    env = env_of(s3)
    if secret is not None:
        env[objectstore.SECRET_KEY_ENV] = secret
    proc = subprocess.Popen([sys.executable, "-m", "finetune_trainer.objectstore", "upload-sidecar",
                             *location_args(s3, "results", key), f"--source={out}", f"--handoff={handoff}",
                             "--max-attempts=1"], env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    assert proc.stdout.readline().startswith("objectstore: waiting for the training container's request")
    return proc, out, handoff


def stop(proc: subprocess.Popen) -> tuple[int, str]:
    proc.terminate()  # the kubelet's SIGTERM once the training container has exited
    _, err = proc.communicate(timeout=30)
    return proc.returncode, err


@pytest.fixture
def training_without_keys(monkeypatch):
    """The training container: finetune_trainer.launch replaced by a stand-in that writes a result
    and exits with the code its last argument names; no key pair anywhere in its environment."""
    from finetune_trainer import launch

    for name in (objectstore.ACCESS_KEY_ENV, objectstore.SECRET_KEY_ENV):
        monkeypatch.delenv(name, raising=False)
    calls: list[list[str]] = []

    def fake_launch(args: list[str]) -> int:
        calls.append(args)
        assert objectstore.ACCESS_KEY_ENV not in os.environ and objectstore.SECRET_KEY_ENV not in os.environ
        return int(args[-1])

    monkeypatch.setattr(launch, "main", fake_launch)
    return calls


def test_the_sidecar_uploads_only_after_training_succeeded_and_the_pod_succeeds_only_then(
        s3, tmp_path, training_without_keys):
    proc, out, handoff = sidecar(s3, tmp_path, "run-1/")
    (out / "adapter").mkdir()
    (out / "adapter" / "adapter_model.safetensors").write_bytes(b"weights")
    report = tmp_path / "termination-log"
    # Training failed: its code, no request, nothing uploaded.
    assert objectstore.main(["train-and-hand-off", f"--handoff={handoff}", f"--report-path={report}", "--",
                             "--config", "c.json", "75"]) == 75
    assert not (handoff / objectstore.REQUEST_FILE).exists()
    time.sleep(4 * objectstore.POLL_SECONDS)  # the sidecar looks for a request meanwhile
    assert not (handoff / objectstore.RESULT_FILE).exists()
    assert "Contents" not in client(s3).list_objects_v2(Bucket="results", Prefix="run-1/")
    # Training succeeded: the sidecar uploads, and only then does the training container exit 0.
    assert objectstore.main(["train-and-hand-off", f"--handoff={handoff}", f"--report-path={report}", "--",
                             "--config", "c.json", "0"]) == 0
    listed = client(s3).list_objects_v2(Bucket="results", Prefix="run-1/")["Contents"]
    assert [o["Key"] for o in listed] == ["run-1/adapter/adapter_model.safetensors"]
    assert proc.poll() is None  # a native sidecar that exited would be restarted and upload again
    code, err = stop(proc)
    assert code == 0, err
    assert training_without_keys[-1] == ["--config", "c.json", "0"]


def test_an_upload_the_sidecar_cannot_do_is_the_training_containers_failure_report(
        s3, tmp_path, training_without_keys):
    proc, out, handoff = sidecar(s3, tmp_path, "run-2/", secret="wrong")
    (out / "model.safetensors").write_bytes(b"weights")
    report = tmp_path / "termination-log"
    code = objectstore.main(["train-and-hand-off", f"--handoff={handoff}", f"--report-path={report}", "--", "0"])
    assert code == contract.EXIT_CODE_FOR_REASON[contract.FailureReason.DATA_ERROR]
    failure = contract.FailureReport.model_validate_json(report.read_text())
    assert failure.reason == contract.FailureReason.DATA_ERROR and failure.phase == contract.Phase.CHECKPOINT
    assert "access denied" in failure.message and "wrong" not in failure.message
    stop(proc)


def test_no_outcome_from_the_sidecar_is_a_bounded_wait_then_a_failure(tmp_path, training_without_keys):
    handoff = tmp_path / "handoff"
    handoff.mkdir()
    report = tmp_path / "termination-log"
    code = objectstore.main(["train-and-hand-off", f"--handoff={handoff}", f"--report-path={report}",
                             "--upload-timeout=1", "--", "0"])
    assert code == contract.EXIT_CODE_FOR_REASON[contract.FailureReason.UNKNOWN]
    assert "no outcome within 1 s" in contract.FailureReport.model_validate_json(report.read_text()).message
    # A result written by a sidecar of an earlier container run is taken as it stands (never a second upload).
    (handoff / objectstore.RESULT_FILE).write_text(objectstore.UploadOutcome(files=3).to_json())
    assert objectstore.main(["train-and-hand-off", f"--handoff={handoff}", f"--report-path={report}", "--", "0"]) == 0


def test_a_sidecar_without_credentials_reports_it_and_waits(tmp_path):
    handoff, out = tmp_path / "handoff", tmp_path / "out"
    handoff.mkdir()
    out.mkdir()
    (handoff / objectstore.REQUEST_FILE).write_text("{}")
    env = {k: v for k, v in os.environ.items() if not k.startswith("FINETUNE_S3_")}
    proc = subprocess.Popen([sys.executable, "-m", "finetune_trainer.objectstore", "upload-sidecar",
                             "--endpoint=http://127.0.0.1:9", "--bucket=b", "--key=k/", f"--source={out}",
                             f"--handoff={handoff}"], env=env, cwd=REPO, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 30
    while not (handoff / objectstore.RESULT_FILE).exists():
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.1)
    outcome = objectstore.UploadOutcome.from_json((handoff / objectstore.RESULT_FILE).read_text())
    assert outcome.failure is not None and "credentials missing" in outcome.failure.message
    assert proc.poll() is None
    code, _ = stop(proc)
    assert code == 0

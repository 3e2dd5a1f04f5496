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


def test_train_and_upload_uploads_only_after_success_on_the_master(s3, tmp_path, monkeypatch):
    """The training container's command: the launcher runs in-process, then the result is uploaded.
    The launcher is replaced by a stand-in that writes a result and exits with a given code."""
    from finetune_trainer import launch

    out = tmp_path / "output"
    seen_env: list[bool] = []

    def fake_launch(args: list[str]) -> int:
        seen_env.append(objectstore.ACCESS_KEY_ENV in os.environ or objectstore.SECRET_KEY_ENV in os.environ)
        out.mkdir(exist_ok=True)
        (out / "model.safetensors").write_bytes(b"weights")
        return int(args[-1])

    monkeypatch.setattr(launch, "main", fake_launch)
    for name, value in env_of(s3).items():
        if name.startswith("FINETUNE_S3_"):
            monkeypatch.setenv(name, value)
    monkeypatch.setenv("PET_NODE_RANK", "0")
    args = ["train-and-upload", *location_args(s3, "results", "run-1/"), f"--source={out}",
            f"--report-path={tmp_path / 'log'}", "--", "--config", "/etc/finetune/config.json"]
    assert objectstore.main([*args, "75"]) == 75  # training failed: its code, nothing uploaded
    assert "Contents" not in client(s3).list_objects_v2(Bucket="results", Prefix="run-1/")
    assert seen_env == [False], "the training processes must not see the object storage credentials"
    for name, value in env_of(s3).items():
        if name.startswith("FINETUNE_S3_"):
            monkeypatch.setenv(name, value)
    monkeypatch.setenv("PET_NODE_RANK", "1")
    assert objectstore.main([*args, "0"]) == 0  # a worker pod: rank 0 (on the master) wrote the result
    assert "Contents" not in client(s3).list_objects_v2(Bucket="results", Prefix="run-1/")
    for name, value in env_of(s3).items():
        if name.startswith("FINETUNE_S3_"):
            monkeypatch.setenv(name, value)
    monkeypatch.setenv("PET_NODE_RANK", "0")
    assert objectstore.main([*args, "0"]) == 0
    listed = client(s3).list_objects_v2(Bucket="results", Prefix="run-1/")["Contents"]
    assert [o["Key"] for o in listed] == ["run-1/model.safetensors"]
    assert json.loads(json.dumps([o["Size"] for o in listed])) == [len(b"weights")]

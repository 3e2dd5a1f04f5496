"""S3-compatible object storage: fetch a job's model or data before training, upload its result after.

``python -m finetune_trainer.objectstore fetch --endpoint=URL --bucket=B --key=K --dest=DIR``
    runs as an init container. A key ending in ``/`` (or empty) is a folder: every object
    under it is downloaded into DIR, keeping the path below the prefix. Any other key is one
    object, downloaded to ``DIR/<last segment of the key>``.

``python -m finetune_trainer.objectstore upload-sidecar --endpoint=URL --bucket=B --key=PREFIX
--source=DIR --handoff=H``
    runs in the master pod's upload sidecar (a native sidecar: an init container with
    ``restartPolicy: Always``, started before the training container and stopped after it). It
    waits for the training container's request (``H/request``), uploads every file under DIR to
    ``PREFIX``, writes the outcome to ``H/result`` and then waits to be stopped.

``python -m finetune_trainer.objectstore train-and-hand-off --handoff=H -- <launch arguments>``
    is the master's training container command when the output is in object storage: it runs
    the launcher in this process and, when training succeeded, asks the sidecar for the upload
    and waits for its outcome, so the pod succeeds only once the result is stored, and an upload
    failure is this container's failure report (the one the operator reads).

Credentials come from the environment, ``FINETUNE_S3_ACCESS_KEY_ID`` and
``FINETUNE_S3_SECRET_ACCESS_KEY``, which the renderer fills from the job's Secret with
``secretKeyRef``: never from the trainer config, never from arguments. They are passed to the
client explicitly, so a pod never falls back to another credential source (instance metadata,
a profile). Only the containers that transfer (the fetch init containers, the upload sidecar)
have them; the training container never does, and its processes cannot read another
container's environment (each container has its own PID namespace).

Requests use path-style addressing (``ENDPOINT/BUCKET/KEY``: what S3-compatible servers
support everywhere), SigV4, and botocore's standard retry mode (transient errors, throttling,
5xx). A failure that a retry cannot fix (no such bucket or object, access denied, bad
credentials) is written as a ``DataError`` failure report to the termination message and
exits 65, so the operator gives up with that reason; a connection that still fails after the
retries is ``Unknown`` (exit 1): not a verdict on the data, though the operator does not retry it
either (recovery retries only memory failures and disruptions).
"""

from __future__ import annotations

import argparse
import json
import os
import posixpath
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, Iterator

from .contract import DEFAULT_REPORT_PATH, EXIT_CODE_FOR_REASON, FailureReason, FailureReport, Phase
from .errors import ConfigError, DataError, TrainerFailure

ACCESS_KEY_ENV = "FINETUNE_S3_ACCESS_KEY_ID"
SECRET_KEY_ENV = "FINETUNE_S3_SECRET_ACCESS_KEY"
DEFAULT_SIGNING_REGION = "us-east-1"
# Error codes of S3 (and of S3-compatible servers) that no retry can fix.
_NOT_FOUND = {"NoSuchBucket", "NoSuchKey", "NotFound", "404"}
_DENIED = {"AccessDenied", "403", "InvalidAccessKeyId", "SignatureDoesNotMatch", "AllAccessDisabled",
           "AccountProblem", "InvalidBucketName", "AuthorizationHeaderMalformed"}


class ObjectStoreError(TrainerFailure):
    """A transfer that failed for a reason that says nothing about the data (the endpoint unreachable
    after the retries, a server error): Unknown, not DataError."""

    reason = FailureReason.UNKNOWN


@dataclass(frozen=True)
class Location:
    """A bucket and a key (one object) or a key prefix (a folder) at an S3-compatible endpoint."""

    endpoint: str
    bucket: str
    key: str
    signing_region: str = DEFAULT_SIGNING_REGION

    @property
    def is_folder(self) -> bool:
        return self.key == "" or self.key.endswith("/")

    def url(self, key: str | None = None) -> str:
        return f"s3://{self.bucket}/{self.key if key is None else key} at {self.endpoint}"


@dataclass(frozen=True)
class Credentials:
    access_key_id: str
    secret_access_key: str

    def __repr__(self) -> str:  # never in a log or a traceback
        return f"Credentials(access_key_id={self.access_key_id!r}, secret_access_key=<hidden>)"

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None, *, remove: bool = False) -> "Credentials":
        env = os.environ if environ is None else environ
        access, secret = env.get(ACCESS_KEY_ENV), env.get(SECRET_KEY_ENV)
        if not access or not secret:
            missing = [n for n, v in ((ACCESS_KEY_ENV, access), (SECRET_KEY_ENV, secret)) if not v]
            raise ConfigError(f"object storage credentials missing: {', '.join(missing)} not set"
                              " (the job's credentialsSecretRef fills them)")
        if remove:
            env.pop(ACCESS_KEY_ENV, None)
            env.pop(SECRET_KEY_ENV, None)
        return cls(access, secret)


def client(location: Location, credentials: Credentials, *, max_attempts: int = 5, timeout: float = 30.0) -> Any:
    """A boto3 S3 client for the location's endpoint: path-style, SigV4, standard retries."""
    import boto3
    from botocore.config import Config

    config = Config(
        signature_version="s3v4",
        s3={"addressing_style": "path"},
        retries={"max_attempts": max_attempts, "mode": "standard"},
        connect_timeout=timeout,
        read_timeout=timeout * 2,
        # Newer botocore adds CRC checksums (and aws-chunked trailers) to every upload; not every
        # S3-compatible server understands them. Only where the operation requires one.
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
    )
    return boto3.session.Session().client(
        "s3",
        endpoint_url=location.endpoint,
        region_name=location.signing_region,
        aws_access_key_id=credentials.access_key_id,
        aws_secret_access_key=credentials.secret_access_key,
        config=config,
    )


def _failure(error: Exception, what: str) -> TrainerFailure:
    """A botocore error as DataError (no retry can fix it) or ObjectStoreError (one may)."""
    from botocore.exceptions import BotoCoreError, ClientError

    if isinstance(error, ClientError):
        info = error.response.get("Error") or {}
        code = str(info.get("Code") or error.response.get("ResponseMetadata", {}).get("HTTPStatusCode", ""))
        message = info.get("Message") or ""
        if code in _NOT_FOUND:
            return DataError(f"{what}: not found ({code}{': ' + message if message else ''})")
        if code in _DENIED:
            return DataError(f"{what}: access denied ({code}{': ' + message if message else ''});"
                             " check the credentials Secret and the bucket's policy")
        return ObjectStoreError(f"{what}: {code} {message}".strip())
    if isinstance(error, BotoCoreError):
        return ObjectStoreError(f"{what}: {error}")
    return ObjectStoreError(f"{what}: {type(error).__name__}: {error}")


def _safe_relative(key: str, prefix: str) -> PurePosixPath | None:
    """The path of `key` below `prefix`, or None for a key that is not a file inside it
    (a folder marker, or `..` / absolute segments that would escape the destination)."""
    relative = key[len(prefix):]
    if not relative or relative.endswith("/"):
        return None
    path = PurePosixPath(relative)
    if path.is_absolute() or any(part in ("..", ".", "") for part in relative.split("/")):
        return None
    return path


def _keys_under(s3: Any, location: Location) -> Iterator[str]:
    paginator = s3.get_paginator("list_objects_v2")
    for page in paginator.paginate(Bucket=location.bucket, Prefix=location.key):
        for item in page.get("Contents") or []:
            yield item["Key"]


def _download(s3: Any, bucket: str, key: str, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    # Into a temporary name first: a half-written file never looks like a complete one.
    handle, partial = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    os.close(handle)
    try:
        s3.download_file(bucket, key, partial)
        os.replace(partial, target)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)


def fetch(s3: Any, location: Location, dest: str | Path) -> list[Path]:
    """Download the object, or every object under the prefix, into `dest`; the files written."""
    from botocore.exceptions import BotoCoreError, ClientError

    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    try:
        if not location.is_folder:
            name = posixpath.basename(location.key)
            try:
                s3.head_object(Bucket=location.bucket, Key=location.key)
            except ClientError as error:
                failure = _failure(error, f"cannot read {location.url()}")
                if isinstance(failure, DataError) and "not found" in str(failure):
                    raise DataError(f"{failure} (for a folder, end the key with '/')") from None
                raise failure from None
            _download(s3, location.bucket, location.key, dest / name)
            return [dest / name]
        skipped = []
        for key in _keys_under(s3, location):
            relative = _safe_relative(key, location.key)
            if relative is None:
                if not key.endswith("/"):
                    skipped.append(key)
                continue
            target = dest.joinpath(*relative.parts)
            _download(s3, location.bucket, key, target)
            written.append(target)
        if skipped:
            print(f"objectstore: skipped keys that would leave {dest}: {skipped[:5]}", file=sys.stderr)
    except TrainerFailure:
        raise
    except (ClientError, BotoCoreError) as error:
        raise _failure(error, f"cannot read {location.url()}") from None
    if not written:
        raise DataError(f"no objects under {location.url()}")
    return written


def upload(s3: Any, source: str | Path, location: Location) -> list[str]:
    """Upload every file under `source` to the location's prefix; the keys written."""
    from botocore.exceptions import BotoCoreError, ClientError

    source = Path(source)
    prefix = location.key if location.is_folder else location.key + "/"
    files = sorted(p for p in source.rglob("*") if p.is_file()) if source.is_dir() else []
    if not files:
        raise DataError(f"nothing to upload: {source} holds no files")
    keys: list[str] = []
    for path in files:
        key = prefix + path.relative_to(source).as_posix()
        try:
            s3.upload_file(str(path), location.bucket, key)
        except (ClientError, BotoCoreError) as error:
            raise _failure(error, f"cannot write {location.url(key)}") from None
        except Exception as error:  # noqa: BLE001 - s3transfer wraps ClientError in its own types
            cause = error.__cause__ or error.__context__
            if isinstance(cause, (ClientError, BotoCoreError)):
                raise _failure(cause, f"cannot write {location.url(key)}") from None
            raise
        keys.append(key)
    return keys


def failure_report(failure: TrainerFailure, phase: Phase) -> FailureReport:
    reason = failure.reason
    return FailureReport(
        reason=reason,
        phase=phase,
        step=0,
        message=f"{type(failure).__name__}: {failure}",
        exit_code=EXIT_CODE_FOR_REASON[reason],
        rank=int(os.environ.get("RANK", "0") or 0),
    )


def report_failure(failure: TrainerFailure, phase: Phase, report_path: str) -> int:
    """Write the failure report to the termination message; the exit code it documents."""
    report = failure_report(failure, phase)
    print(f"objectstore: {report.message}", file=sys.stderr)
    return write_report(report, report_path)


def write_report(report: FailureReport, report_path: str) -> int:
    try:
        Path(report_path).write_text(report.to_termination_message())
    except OSError as error:
        print(f"objectstore: cannot write the failure report to {report_path}: {error}", file=sys.stderr)
    return report.exit_code


def _location(args: argparse.Namespace) -> Location:
    return Location(endpoint=args.endpoint, bucket=args.bucket, key=args.key, signing_region=args.signing_region)


def _add_location(parser: argparse.ArgumentParser) -> None:
    # Spelled `--key=VALUE` by the renderer, so a value starting with '-' is never read as an option.
    parser.add_argument("--endpoint", required=True, help="e.g. https://s3.eu-de-berlin.example")
    parser.add_argument("--bucket", required=True)
    parser.add_argument("--key", required=True, help="an object key, or a prefix ending in '/'")
    parser.add_argument("--signing-region", default=DEFAULT_SIGNING_REGION)
    parser.add_argument("--report-path", default=DEFAULT_REPORT_PATH)
    parser.add_argument("--max-attempts", type=int, default=5, help="attempts per request (botocore standard retries)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="finetune_trainer.objectstore", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    fetch_cmd = commands.add_parser("fetch", help="download an object or a prefix into a folder")
    _add_location(fetch_cmd)
    fetch_cmd.add_argument("--dest", required=True)
    fetch_cmd.add_argument("--phase", choices=[p.value for p in (Phase.LOAD, Phase.DATA)], default=Phase.DATA.value,
                           help="the phase a failure report names: load (the model) or data")
    upload_cmd = commands.add_parser("upload", help="upload a folder to a prefix")
    _add_location(upload_cmd)
    upload_cmd.add_argument("--source", required=True)
    sidecar_cmd = commands.add_parser("upload-sidecar", help="wait for the training container, upload, report")
    _add_location(sidecar_cmd)
    sidecar_cmd.add_argument("--source", required=True)
    sidecar_cmd.add_argument("--handoff", required=True, help="the folder both containers share")
    run_cmd = commands.add_parser("train-and-hand-off", help="run finetune_trainer.launch, then have the sidecar upload")
    run_cmd.add_argument("--handoff", required=True, help="the folder both containers share")
    run_cmd.add_argument("--report-path", default=DEFAULT_REPORT_PATH)
    run_cmd.add_argument("--upload-timeout", type=float, default=DEFAULT_UPLOAD_TIMEOUT_SECONDS,
                         help="seconds to wait for the sidecar's outcome")
    run_cmd.add_argument("launch_args", nargs=argparse.REMAINDER, help="-- then finetune_trainer.launch's arguments")
    args = parser.parse_args(argv)

    if args.command == "train-and-hand-off":
        return train_and_hand_off(Path(args.handoff), list(args.launch_args), args.report_path, args.upload_timeout)

    location = _location(args)
    if args.command == "fetch":
        phase = Phase(args.phase)
        try:
            files = fetch(client(location, Credentials.from_env(), max_attempts=args.max_attempts), location, args.dest)
        except TrainerFailure as failure:
            return report_failure(failure, phase, args.report_path)
        print(f"objectstore: fetched {len(files)} file(s) from {location.url()} into {args.dest}")
        return 0

    if args.command == "upload":
        try:
            keys = upload(client(location, Credentials.from_env(), max_attempts=args.max_attempts), args.source, location)
        except TrainerFailure as failure:
            return report_failure(failure, Phase.CHECKPOINT, args.report_path)
        print(f"objectstore: uploaded {len(keys)} file(s) to {location.url()}")
        return 0

    return upload_sidecar(location, Path(args.source), Path(args.handoff), args.max_attempts)


# --------------------------------------------------------------------------- the hand-off
# The training container and the upload sidecar share one small emptyDir. Each file is written
# under a temporary name and renamed, so the other side never reads half of one.
REQUEST_FILE = "request"
RESULT_FILE = "result"
POLL_SECONDS = 0.5
# A result of hundreds of GB over a slow link: hours, not forever (the pod would hold its GPUs).
DEFAULT_UPLOAD_TIMEOUT_SECONDS = 6 * 3600.0


@dataclass(frozen=True)
class UploadOutcome:
    """What the sidecar says of the upload: the files written, or the failure report to pass on."""

    files: int = 0
    failure: FailureReport | None = None

    def to_json(self) -> str:
        return json.dumps({"files": self.files, "failure": None if self.failure is None
                           else json.loads(self.failure.to_termination_message())})

    @classmethod
    def from_json(cls, text: str) -> "UploadOutcome":
        data = json.loads(text)
        failure = data.get("failure")
        return cls(files=int(data.get("files") or 0),
                   failure=None if failure is None else FailureReport.model_validate(failure))


def _write_atomically(path: Path, text: str) -> None:
    partial = path.with_name(f".{path.name}.partial")
    partial.write_text(text)
    os.replace(partial, path)


def _stop_on_sigterm() -> threading.Event:
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda signum, frame: stop.set())
    return stop


def upload_sidecar(location: Location, source: Path, handoff: Path, max_attempts: int = 5,
                   stop: threading.Event | None = None) -> int:
    """The sidecar: wait for the request, upload once, write the outcome, wait to be stopped. It
    never exits on its own before it is stopped: a native sidecar that exits is restarted, and
    a restarted one would upload again."""
    stop = stop or _stop_on_sigterm()
    result = handoff / RESULT_FILE
    print(f"objectstore: waiting for the training container's request in {handoff}", flush=True)
    while not stop.is_set() and not result.exists():
        if (handoff / REQUEST_FILE).exists():
            try:
                keys = upload(client(location, Credentials.from_env(), max_attempts=max_attempts), source, location)
                outcome = UploadOutcome(files=len(keys))
                print(f"objectstore: uploaded {len(keys)} file(s) of the result to {location.url()}")
            except TrainerFailure as failure:
                outcome = UploadOutcome(failure=failure_report(failure, Phase.CHECKPOINT))
                print(f"objectstore: {outcome.failure.message}", file=sys.stderr)
            _write_atomically(result, outcome.to_json())
            break
        stop.wait(POLL_SECONDS)
    stop.wait()
    return 0


def train_and_hand_off(handoff: Path, launch_args: list[str], report_path: str,
                       timeout: float = DEFAULT_UPLOAD_TIMEOUT_SECONDS) -> int:
    """The master's training container: train, then have the sidecar upload and take its outcome."""
    from . import launch

    if launch_args[:1] == ["--"]:
        launch_args = launch_args[1:]
    code = launch.main(launch_args)
    # The launcher forwarded SIGTERM to torchrun, which has exited: a pod deleted while it waits
    # for the upload must stop now, not after its grace period.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if code != 0:
        return code
    _write_atomically(handoff / REQUEST_FILE, "{}")
    deadline = time.monotonic() + timeout
    result = handoff / RESULT_FILE
    while not result.exists():
        if time.monotonic() > deadline:
            return report_failure(ObjectStoreError(
                f"the upload sidecar gave no outcome within {timeout:.0f} s"), Phase.CHECKPOINT, report_path)
        time.sleep(POLL_SECONDS)
    try:
        outcome = UploadOutcome.from_json(result.read_text())
    except (OSError, ValueError) as error:
        return report_failure(ObjectStoreError(f"the upload sidecar's outcome is unreadable: {error}"),
                              Phase.CHECKPOINT, report_path)
    if outcome.failure is not None:
        return write_report(outcome.failure, report_path)
    print(f"objectstore: the sidecar uploaded {outcome.files} file(s) of the result")
    return 0


if __name__ == "__main__":
    sys.exit(main())

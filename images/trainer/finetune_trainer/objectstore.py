"""S3-compatible object storage: fetch a job's model or data before training, upload its result after.

``python -m finetune_trainer.objectstore fetch --endpoint=URL --bucket=B --key=K --dest=DIR``
    runs as an init container. A key ending in ``/`` (or empty) is a folder: every object
    under it is downloaded into DIR, keeping the path below the prefix. Any other key is one
    object, downloaded to ``DIR/<last segment of the key>``.

``python -m finetune_trainer.objectstore train-and-upload --endpoint=URL --bucket=B --key=PREFIX
--source=DIR -- <finetune_trainer.launch arguments>``
    is the training container's command when the job's output is in object storage: it runs
    the launcher in this process and, when training succeeded on the master pod (node rank 0,
    where rank 0 writes the result), uploads every file under DIR to ``PREFIX``.

Credentials come from the environment, ``FINETUNE_S3_ACCESS_KEY_ID`` and
``FINETUNE_S3_SECRET_ACCESS_KEY``, which the renderer fills from the job's Secret with
``secretKeyRef``: never from the trainer config, never from arguments. They are passed to the
client explicitly, so a pod never falls back to another credential source (instance metadata,
a profile). ``train-and-upload`` removes them from the environment before training starts, so
the training processes never see them.

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
import os
import posixpath
import signal
import sys
import tempfile
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


def report_failure(failure: TrainerFailure, phase: Phase, report_path: str) -> int:
    """Write the failure report to the termination message; the exit code it documents."""
    reason = failure.reason
    report = FailureReport(
        reason=reason,
        phase=phase,
        step=0,
        message=f"{type(failure).__name__}: {failure}",
        exit_code=EXIT_CODE_FOR_REASON[reason],
        rank=int(os.environ.get("RANK", "0") or 0),
    )
    print(f"objectstore: {report.message}", file=sys.stderr)
    try:
        Path(report_path).write_text(report.to_termination_message())
    except OSError as error:
        print(f"objectstore: cannot write the failure report to {report_path}: {error}", file=sys.stderr)
    return report.exit_code


def is_master_pod(environ: dict[str, str] | None = None) -> bool:
    """Node rank 0: the pod whose rank 0 writes the result (the training operator sets these)."""
    env = os.environ if environ is None else environ
    for name in ("PET_NODE_RANK", "GROUP_RANK", "RANK"):
        value = env.get(name)
        if value not in (None, ""):
            return value.strip() == "0"
    return True


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
    run_cmd = commands.add_parser("train-and-upload", help="run finetune_trainer.launch, then upload its result")
    _add_location(run_cmd)
    run_cmd.add_argument("--source", required=True)
    run_cmd.add_argument("launch_args", nargs=argparse.REMAINDER, help="-- then finetune_trainer.launch's arguments")
    args = parser.parse_args(argv)
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

    # train-and-upload: the credentials leave the environment before the training processes start.
    try:
        credentials = Credentials.from_env(remove=True)
    except TrainerFailure as failure:
        return report_failure(failure, Phase.SETUP, args.report_path)
    from . import launch

    launch_args = list(args.launch_args)
    if launch_args[:1] == ["--"]:
        launch_args = launch_args[1:]
    code = launch.main(launch_args)
    # The launcher forwarded SIGTERM to torchrun, which has exited: a pod deleted during the upload
    # must stop now, not after its grace period.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if code != 0 or not is_master_pod():
        return code
    try:
        keys = upload(client(location, credentials, max_attempts=args.max_attempts), args.source, location)
    except TrainerFailure as failure:
        return report_failure(failure, Phase.CHECKPOINT, args.report_path)
    print(f"objectstore: uploaded {len(keys)} file(s) of the result to {location.url()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

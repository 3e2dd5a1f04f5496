"""The lab's S3-compatible object storage: rclone `serve s3` (built by `python -m e2e.lab build`
from e2e/lab/s3server at RCLONE_VERSION) over a folder, on a free loopback port.

    python -m e2e.lab.objectstore [--port N] [DIR]     # serve DIR (a temporary one by default)
                                                        # until Ctrl-C; prints endpoint and keys

Buckets are the folders of DIR. The server requires SigV4 with the lab's key pair; it is a
real S3 implementation (rclone's gofakes3-based server over its local backend), not a mock:
path-style and virtual-host requests, listings, multipart uploads, errors such as NoSuchKey,
NoSuchBucket and SignatureDoesNotMatch are answered as S3 answers them.
"""

from __future__ import annotations

import argparse
import os
import secrets
import socket
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from . import processes
from .build import find_s3_server


@dataclass
class S3Server:
    """One running server; `stop()` ends it (by pid) and keeps or removes nothing else."""

    binary: Path
    root: Path  # the served folder: one sub-folder per bucket
    workdir: Path  # config and log
    access_key_id: str = field(default_factory=lambda: "lab" + secrets.token_hex(6))
    secret_access_key: str = field(default_factory=lambda: secrets.token_urlsafe(24))
    port: int = 0
    # The address it listens on: loopback for the lab's local processes; the real node's bridge
    # gateway (realnode.GATEWAY) for pods in real containers, which cannot reach the host's loopback.
    host: str = "127.0.0.1"
    proc: processes.Proc | None = None

    @property
    def endpoint(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, port: int = 0, timeout: float = 30.0, die_with_parent: bool = True) -> "S3Server":
        self.root.mkdir(parents=True, exist_ok=True)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port = port or processes.free_port()
        config = self.workdir / "rclone.conf"
        config.touch()
        env = {
            **os.environ,
            # rclone reads every flag from RCLONE_<FLAG>: the key pair stays out of the process list.
            # A list flag's variable is CSV; the pair, which holds a comma, is one quoted field.
            "RCLONE_AUTH_KEY": f'"{self.access_key_id},{self.secret_access_key}"',
            "RCLONE_CONFIG": str(config),
        }
        argv = [str(self.binary), "serve", "s3", "--addr", f"{self.host}:{self.port}", str(self.root)]
        self.proc = processes.start("s3-server", argv, self.workdir, env=env, die_with_parent=die_with_parent)
        processes.wait_until(f"the S3 server on {self.endpoint}", self._listening, self.proc, timeout)
        return self

    def _listening(self) -> bool:
        with socket.create_connection((self.host, self.port), timeout=1):
            return True

    def stop(self) -> None:
        if self.proc is not None:
            processes.stop([self.proc])
            self.proc = None

    def make_bucket(self, name: str) -> Path:
        """A bucket is a folder of the served root."""
        path = self.root / name
        path.mkdir(parents=True, exist_ok=True)
        return path


def server(workdir: Path | None = None) -> S3Server | None:
    """An S3Server (not started) over `workdir`/data, or None when the binary is not built."""
    binary = find_s3_server()
    if binary is None:
        return None
    workdir = workdir or Path(tempfile.mkdtemp(prefix="finetune-s3-"))
    return S3Server(binary=binary, root=workdir / "data", workdir=workdir)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m e2e.lab.objectstore", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("dir", nargs="?", help="the folder to serve (default: a new temporary one)")
    args = parser.parse_args(argv)
    workdir = Path(args.dir) if args.dir else None
    s3 = server(workdir)
    if s3 is None:
        print("the S3 server is not built: run `python -m e2e.lab build`", file=sys.stderr)
        return 1
    s3.start(args.port, die_with_parent=False)
    print(f"S3 endpoint {s3.endpoint}\naccess key id {s3.access_key_id}\nsecret access key {s3.secret_access_key}\n"
          f"buckets are the folders of {s3.root}; log {s3.proc.log if s3.proc else ''}\nCtrl-C stops it")
    try:
        while s3.proc is not None and processes.is_alive(s3.proc):
            time.sleep(1)
    except KeyboardInterrupt:
        pass
    finally:
        s3.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Progress to Kubeflow Trainer's status endpoint, where the cluster offers one.

Kubeflow Trainer v2.2+ with its TrainJobStatus feature gate gives every pod of a TrainJob three
variables: the HTTPS address that takes the job's status (KUBEFLOW_TRAINER_SERVER_URL), the CA
that signs it (KUBEFLOW_TRAINER_SERVER_CA_CERT) and a projected service-account token for that
address alone (KUBEFLOW_TRAINER_SERVER_TOKEN; its audience is the TrainJob, so it opens nothing
on the API server, and our pods still mount no API token). Where the three are set, rank 0 sends
each progress report there as well as to its log; the operator then reads status.trainerStatus
instead of the pod log (finetune_operator.progress), and `kubectl get trainjob` shows it too.

Reporting must never slow or break training: a background thread sends the newest report at most
every MIN_INTERVAL_SECONDS (Trainer's guidance is one every 5 s), each request has a timeout, a
report that arrives while one is sent replaces the waiting one, and a failure is logged once and
then quietly (the log line is still there; the operator falls back to it).
"""

from __future__ import annotations

import json
import logging
import os
import ssl
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Callable, Mapping

from .contract import ProgressReport, trainer_status_payload

log = logging.getLogger("finetune_trainer.trainjob_status")

URL_ENV = "KUBEFLOW_TRAINER_SERVER_URL"
CA_ENV = "KUBEFLOW_TRAINER_SERVER_CA_CERT"
TOKEN_ENV = "KUBEFLOW_TRAINER_SERVER_TOKEN"
MIN_INTERVAL_SECONDS = 5.0
REQUEST_TIMEOUT_SECONDS = 5.0


@dataclass(frozen=True)
class Endpoint:
    url: str
    ca_file: str
    token_file: str

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> "Endpoint | None":
        url, ca, token = environ.get(URL_ENV), environ.get(CA_ENV), environ.get(TOKEN_ENV)
        if not (url and ca and token):
            return None
        if not url.startswith("https://"):
            # The token must not travel in the clear; Trainer's endpoint is always HTTPS.
            log.warning("%s is not an https:// address; progress is not sent there", URL_ENV)
            return None
        return cls(url, ca, token)


def rfc3339(unix_seconds: float) -> str:
    return datetime.fromtimestamp(unix_seconds, tz=timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def post(endpoint: Endpoint, body: dict) -> None:
    """One POST. The token is read anew each time: the kubelet rotates the projected file."""
    with open(endpoint.token_file, encoding="utf-8") as f:
        token = f.read().strip()
    context = ssl.create_default_context(cafile=endpoint.ca_file)
    request = urllib.request.Request(endpoint.url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Authorization": f"Bearer {token}",
                                              "Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_SECONDS, context=context) as response:
        response.read()


class StatusReporter:
    """Sends the newest progress report in the background, at most every `min_interval` seconds."""

    def __init__(self, endpoint: Endpoint, *, min_interval: float = MIN_INTERVAL_SECONDS,
                 send: Callable[[Endpoint, dict], None] = post, clock: Callable[[], float] = time.monotonic):
        self.endpoint, self.min_interval, self.send, self.clock = endpoint, min_interval, send, clock
        self._pending: dict | None = None
        self._lock = threading.Condition()
        self._closed = False
        self._last_sent: float | None = None
        self._failures = 0
        self.sent = 0
        self._thread = threading.Thread(target=self._run, name="trainjob-status", daemon=True)
        self._thread.start()

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> "StatusReporter | None":
        endpoint = Endpoint.from_env(environ)
        return None if endpoint is None else cls(endpoint)

    def submit(self, report: ProgressReport, started: float) -> None:
        """Queue `report` (replacing one not sent yet). `started`: when the attempt's loop began
        (Unix seconds), for the time left at the attempt's own rate."""
        remaining = None
        done = report.step - (report.start_step or 0)
        if done > 0 and report.time > started:
            remaining = (report.max_steps - report.step) * (report.time - started) / done
        body = trainer_status_payload(report, remaining_seconds=remaining, updated=rfc3339(report.time))
        with self._lock:
            self._pending = body
            self._lock.notify()

    def close(self, timeout: float = REQUEST_TIMEOUT_SECONDS + 1) -> None:
        """Send what is waiting now (the final report must not wait out the interval), then stop."""
        with self._lock:
            self._closed = True
            self._lock.notify()
        self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            with self._lock:
                while self._pending is None and not self._closed:
                    self._lock.wait()
                if self._pending is None:
                    return
                wait = 0.0 if self._last_sent is None or self._closed else \
                    self._last_sent + self.min_interval - self.clock()
                if wait > 0:
                    self._lock.wait(wait)  # a newer report or close() may arrive meanwhile
                    continue
                body, self._pending = self._pending, None
                self._last_sent = self.clock()
            try:
                self.send(self.endpoint, body)
                self.sent += 1
                self._failures = 0
            except (OSError, ValueError, urllib.error.URLError, ssl.SSLError) as error:
                self._failures += 1
                (log.warning if self._failures == 1 else log.debug)(
                    "progress not sent to %s (the pod log still has it): %s", self.endpoint.url, error)

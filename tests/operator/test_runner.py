"""The operator's process (shell/runner.py): start, /healthz once started, SIGTERM stops it with the
shutdown, a start that fails exits 1 after handing back what it took; its JSON log lines."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest

from finetune_operator.shell import runner


@pytest.fixture
def signals():
    """run() installs its handlers for SIGTERM and SIGINT: put pytest's back afterwards."""
    before = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGINT)}
    yield
    for signum, handler in before.items():
        signal.signal(signum, handler)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _get(port: int, path: str = "/healthz") -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read() or b"{}") if error.code != 404 else {}


def test_sigterm_stops_the_operator_after_it_served_healthz(signals):
    port = _free_port()
    calls: list[str] = []
    answers: list[tuple[int, dict]] = []

    def probe_then_terminate() -> None:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                answers.append(_get(port))
                answers.append(_get(port, "/other"))
                break
            except OSError:
                time.sleep(0.05)  # not serving yet: the start has not returned
        os.kill(os.getpid(), signal.SIGTERM)

    def start() -> None:
        calls.append("start")
        threading.Thread(target=probe_then_terminate, daemon=True).start()

    code = runner.run(start, lambda: calls.append("stop"), health_port=port, dead=lambda: [])
    assert code == 0 and calls == ["start", "stop"]
    assert answers == [(200, {"threads": "alive"}), (404, {})]
    with pytest.raises(OSError):  # the server is gone with the process's work
        socket.create_connection(("127.0.0.1", port), timeout=1).close()


def test_healthz_names_the_dead_threads():
    dead: list[str] = []
    server = runner.serve_health(0, lambda: list(dead), host="127.0.0.1")
    try:
        port = server.server_address[1]
        assert _get(port) == (200, {"threads": "alive"})
        dead.append("informer-nodes")
        assert _get(port) == (500, {"dead": ["informer-nodes"]})
    finally:
        server.shutdown()
        server.server_close()


def test_a_start_that_fails_exits_1_after_the_shutdown(signals, caplog):
    calls: list[str] = []

    def start() -> None:
        calls.append("start")
        raise RuntimeError("policy ConfigMap has no 'policy.yaml'")

    port = _free_port()
    with caplog.at_level(logging.ERROR, logger="finetune_operator"):
        code = runner.run(start, lambda: calls.append("stop"), health_port=port, dead=lambda: [])
    assert code == 1 and calls == ["start", "stop"]
    assert "could not start" in caplog.text and "has no 'policy.yaml'" in caplog.text
    with pytest.raises(OSError):  # never healthy
        socket.create_connection(("127.0.0.1", port), timeout=1).close()


def test_json_log_lines():
    formatter = runner.JsonFormatter()
    record = logging.LogRecord("finetune_operator.informers", logging.WARNING, __file__, 1, "%s: retrying", ("nodes",),
                               None)
    line = json.loads(formatter.format(record))
    assert line["level"] == "warning" and line["logger"] == "finetune_operator.informers"
    assert line["message"] == "nodes: retrying" and line["time"].endswith("+00:00")
    try:
        raise ValueError("boom")
    except ValueError:
        import sys

        record = logging.LogRecord("x", logging.ERROR, __file__, 1, "failed", (), sys.exc_info())
    assert "ValueError: boom" in json.loads(formatter.format(record))["exception"]

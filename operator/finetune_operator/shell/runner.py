"""The operator's process: its logging, `/healthz`, and the signals that stop it.

`run` calls `start`, serves the liveness endpoint, waits for SIGTERM or SIGINT, and calls `stop`.
Everything the operator does runs in threads that `start` starts (informers, the work queue's
workers, the election, the pollers); the main thread only waits here. A `start` that fails logs
why and makes the process exit 1 (the kubelet restarts the container, with its back-off), after
`stop` has handed back whatever `start` had taken (the Lease).
"""

from __future__ import annotations

import json
import logging
import signal
import threading
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable

log = logging.getLogger("finetune_operator")

HEALTH_PATH = "/healthz"
# A probe that connects and sends nothing must not hold a server thread for long.
HEALTH_REQUEST_SECONDS = 5.0


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time (UTC), level, logger, message and, with one, the exception."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, timezone.utc).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(), "logger": record.name, "message": record.getMessage()}
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, ensure_ascii=False)


def configure_logging(log_format: str, level: str) -> None:
    """`log_format` json or plain, on stderr; `level` debug, info, warning or error."""
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if log_format == "json"
                         else logging.Formatter("[%(asctime)s] %(levelname)-7s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


class HealthServer(ThreadingHTTPServer):
    """Answers GET /healthz: 200 while `dead()` names no thread, else 500 naming them."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], dead: Callable[[], list[str]]) -> None:
        super().__init__(address, _Health)
        self.dead = dead


class _Health(BaseHTTPRequestHandler):
    timeout = HEALTH_REQUEST_SECONDS
    server: HealthServer

    def do_GET(self) -> None:  # noqa: N802 - the name http.server calls
        if self.path.split("?", 1)[0] != HEALTH_PATH:
            self.send_error(404)
            return
        dead = self.server.dead()
        body = json.dumps({"dead": dead} if dead else {"threads": "alive"}).encode()
        self.send_response(500 if dead else 200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - http.server's signature
        pass  # a probe every few seconds says nothing worth a log line


def serve_health(port: int, dead: Callable[[], list[str]], host: str = "0.0.0.0") -> HealthServer:
    """The liveness endpoint on `port` (0: any free port), answered from a thread of its own."""
    server = HealthServer((host, port), dead)
    threading.Thread(target=server.serve_forever, name="healthz", daemon=True).start()
    return server


def run(start: Callable[[], None], stop: Callable[[], None], *, health_port: int | None,
        dead: Callable[[], list[str]]) -> int:
    """Start, serve /healthz (on `health_port`, if any) once started, wait for SIGTERM or SIGINT, stop.
    The exit status: 0 after a stop, 1 when `start` failed."""
    stopping = threading.Event()

    def on_signal(signum: int, _frame: Any) -> None:
        log.info("%s: stopping", signal.Signals(signum).name)
        stopping.set()

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, on_signal)
    try:
        start()
    except Exception:
        log.exception("could not start")
        stop()
        return 1
    server = serve_health(health_port, dead) if health_port else None
    # A timed wait: the main thread runs the signal handler between two waits at the latest.
    while not stopping.wait(1.0):
        pass
    stop()
    if server is not None:
        server.shutdown()
        server.server_close()
    return 0

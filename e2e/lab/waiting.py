"""Polling with a deadline and a message that says what was awaited."""

from __future__ import annotations

import json
import time
from typing import Any, Callable, TypeVar

T = TypeVar("T")


def wait_for(check: Callable[[], T], timeout: float, what: str, interval: float = 0.25) -> T:
    """Return check()'s first truthy value; raise TimeoutError naming `what` (and the last
    value or error seen) after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    last: object = None
    while True:
        try:
            value = check()
            if value:
                return value
            last = value
        except Exception as exc:  # the thing awaited may not exist yet
            last = exc
        if time.monotonic() >= deadline:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what} (last: {last!r})")
        time.sleep(interval)


def wait_crd_established(lab: Any, *names: str, timeout: float = 60) -> None:
    """Until every CRD of `names` (e.g. "finetunejobs.finetune.dev") is Established. Not `kubectl
    wait`: it fails at once ("conditions accessor error") when it reads a CRD the API server has not
    given any condition yet, which a CRD applied a moment ago often is."""

    def established(name: str) -> bool:
        proc = lab.kubectl("get", f"crd/{name}", "-o", "json", check=False)
        if proc.returncode != 0:
            return False
        conditions = (json.loads(proc.stdout).get("status") or {}).get("conditions") or []
        return any(c.get("type") == "Established" and c.get("status") == "True" for c in conditions)

    wait_for(lambda: all(established(n) for n in names), timeout, f"CRDs {', '.join(names)} Established", 0.2)

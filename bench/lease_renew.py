"""Lease renew latency of a loaded, GIL-bound operator process: the real election (the client
library's LeaderElection with leadership.BoundedLeaseLock, the operator's timings and its Lease
client from apiclient.py) renews a Lease served by a small HTTP server in another process (the API
server is another process too), while N threads of this process hold the GIL with CPU work
(JSON encoding and decoding of job-sized documents, which holds the GIL as planning and status
writes do).

    python bench/lease_renew.py [--load 0 8 64] [--seconds 60]

Prints per load: renews, the renew request's latency (get + update: p50, p99, max), the longest gap
between two renews a standby would see (renewTime to renewTime), and whether the leader was ever
deposed (a gap over the renew deadline, or the library's onstopped_leading). Measures the
process, not the API server: the server here answers at once.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import sys
import threading
import time
from http.server import ThreadingHTTPServer
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "operator"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "images" / "trainer"))

from kubernetes import client  # noqa: E402
from kubernetes.leaderelection import electionconfig, leaderelection  # noqa: E402

from e2e.chaos import LeaseEndpoint  # noqa: E402
from finetune_operator.shell.apiclient import LEASE_TIMEOUT, bounded_client  # noqa: E402
from finetune_operator.shell.leadership import (LEASE_DURATION_SECONDS, RENEW_DEADLINE_SECONDS,  # noqa: E402
                                          RETRY_PERIOD_SECONDS, BoundedLeaseLock)

def serve(port_queue: multiprocessing.Queue) -> None:
    """The Lease endpoint, in a process of its own (as the API server is)."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), LeaseEndpoint)
    port_queue.put(server.server_address[1])
    server.serve_forever()


def load(stop: threading.Event) -> None:
    doc = {"status": {"conditions": [{"type": f"C{i}", "message": "x" * 200} for i in range(40)],
                      "attempts": [{"attempt": i, "plan": {"breakdown": {"k": list(range(50))}}} for i in range(10)]}}
    while not stop.is_set():
        json.loads(json.dumps(doc))


def run(port: int, threads: int, seconds: float) -> dict:
    cfg = client.Configuration()
    cfg.host = f"http://127.0.0.1:{port}"
    lock = BoundedLeaseLock("bench", "bench", "bench-leader")
    lock.api_instance = client.CoordinationV1Api(bounded_client(cfg, LEASE_TIMEOUT, retries=False))
    latencies: list[float] = []
    renewed: list[float] = []
    stopped = threading.Event()
    get, update = lock.get, lock.update

    def timed_get(name, namespace):
        timed_get.started = time.monotonic()
        return get(name, namespace)

    def timed_update(name, namespace, record):
        ok = update(name, namespace, record)
        if ok:
            now = time.monotonic()
            latencies.append(now - timed_get.started)
            renewed.append(now)
        return ok

    lock.get, lock.update = timed_get, timed_update
    config = electionconfig.Config(lock, lease_duration=LEASE_DURATION_SECONDS, renew_deadline=RENEW_DEADLINE_SECONDS,
                                   retry_period=RETRY_PERIOD_SECONDS, onstarted_leading=lambda: None,
                                   onstopped_leading=stopped.set)
    threading.Thread(target=leaderelection.LeaderElection(config).run, daemon=True).start()
    halt = threading.Event()
    workers = [threading.Thread(target=load, args=(halt,), daemon=True) for _ in range(threads)]
    for worker in workers:
        worker.start()
    time.sleep(seconds)
    halt.set()
    gaps = [b - a for a, b in zip(renewed, renewed[1:])]
    ordered = sorted(latencies)
    return {"load_threads": threads, "renews": len(latencies),
            "latency_p50_ms": round(1000 * statistics.median(ordered), 1) if ordered else None,
            "latency_p99_ms": round(1000 * ordered[int(0.99 * (len(ordered) - 1))], 1) if ordered else None,
            "latency_max_ms": round(1000 * ordered[-1], 1) if ordered else None,
            "max_gap_s": round(max(gaps), 2) if gaps else None,
            "deposed": stopped.is_set() or any(g > RENEW_DEADLINE_SECONDS for g in gaps)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--load", type=int, nargs="+", default=[0, 8, 64])
    parser.add_argument("--seconds", type=float, default=60)
    args = parser.parse_args()
    ports: multiprocessing.Queue = multiprocessing.Queue()
    for threads in args.load:
        server = multiprocessing.Process(target=serve, args=(ports,), daemon=True)
        server.start()
        print(json.dumps(run(ports.get(timeout=10), threads, args.seconds)), flush=True)
        server.terminate()


if __name__ == "__main__":
    main()

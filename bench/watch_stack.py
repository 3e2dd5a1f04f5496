"""What the operator's watch stack costs, measured on the lab for one or more checkouts.

    python bench/watch_stack.py [--source DIR ...] [--jobs 200] [--interval 0.2] [--kopf-runner] [--json-out FILE]
    python bench/watch_stack.py --paired [--jobs 200] [--interval 0.2]

Run it under the lab lock: `flock /tmp/finetune-lab.lock python bench/watch_stack.py ...`.

For each --source (a checkout of this repository; default: this one) it starts its own lab (real
etcd, kube-apiserver, scheduler, kwok, the Kubeflow training operator), installs that checkout's
CRD and chart (its RBAC: the operator runs as the chart's ServiceAccount, e2e/operator_harness.py)
and runs that checkout's operator (`finetune-operator run`, its code on PYTHONPATH). Then it applies
--jobs FineTuneJobs one every --interval seconds (examples/llama-8b-lora.yaml, 20 steps, 5 s on the
fake GPU) and reads:

  apply -> first status   from the create call's return to the job's first status (the first
                          reconcile's write) seen by the benchmark's own watch: the event's way
                          through the operator's watch stack into the work queue, plus one reconcile,
                          p50 / p99 / max
  operator CPU            user+system seconds of the operator process from before the first apply
                          until every job had its status
  reconciles              how many it ran by then and their mean time (its finetune_reconcile_seconds),
                          those that planned and the others
  watches                 WATCH requests the API server holds for the operator (its
                          apiserver_longrunning_requests, less what it held before the operator ran),
                          by resource (read once the lab's own count has held still for 35 s: its
                          garbage collector starts watching a new CRD's kind within 30 s)
  API connections         the operator's established TCP connections to the API server
  threads, RSS            of the operator process 10 s after the last status (VmRSS), and its peak
                          (VmHWM)
  start -> healthy        from the process's start to its /healthz answering 200

With --kopf-runner it also runs, on the same lab and as the same ServiceAccount, kopf with no handler
but its login (what kopf would be if it only ran the process) for 15 s, and reads its watches, API
connections, threads and RSS the same way (kopf must be importable).

With --paired it measures the two watch stacks themselves, side by side in this one process on one lab
(same events, same load, same interpreter): kopf as the operator configured it until it was dropped
(one event handler on FineTuneJobs; batch window 0.01 s, its timeouts) and an informer
(`informer.Informer` on `apiclient`'s bounded client), both watching FineTuneJobs while --jobs are
applied one every --interval seconds: from the create call's return to each stack's handler, p50 /
p99 / max, and the paired difference kopf - informer per job.

Compare figures only between sources measured in the same run (same machine, same load).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from e2e import chaos as ch  # noqa: E402
from e2e import operator_harness as h  # noqa: E402

RESULTS = ROOT / "bench" / "results"
NAMESPACE = "watch-bench"

# kopf running the process only: no resource handler, its login from the ServiceAccount's kubeconfig.
KOPF_RUNNER = """
import sys
import kopf
from kubernetes import client, config


@kopf.on.login()
def login(**_):
    cfg = client.Configuration()
    config.load_kube_config(config_file=sys.argv[1], client_configuration=cfg)
    scheme, _, token = ((cfg.api_key or {}).get("BearerToken") or "").partition(" ")
    return kopf.ConnectionInfo(server=cfg.host, ca_path=cfg.ssl_ca_cert, scheme=scheme or None, token=token or None)


kopf.run(standalone=True, clusterwide=True)
"""
WATCHES = re.compile(r'^apiserver_longrunning_requests\{([^}]*)\}\s+([0-9.e+]+)$')


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def watches_by_resource(lab: Any) -> dict[str, int]:
    """The WATCH requests the API server holds now, by resource (its own metric)."""
    text = lab.kubectl("get", "--raw", "/metrics").stdout
    out: dict[str, int] = {}
    for line in text.splitlines():
        match = WATCHES.match(line)
        if not match:
            continue
        labels = dict(re.findall(r'(\w+)="([^"]*)"', match.group(1)))
        if labels.get("verb") != "WATCH":
            continue
        resource = labels.get("resource", "?") + (f".{labels['group']}" if labels.get("group") else "")
        out[resource] = out.get(resource, 0) + int(float(match.group(2)))
    return out


def reconcile_seconds(metrics_text: str) -> dict[str, dict[str, float]]:
    """The operator's finetune_reconcile_seconds histogram: count and mean, by its `planned` label."""
    out: dict[str, dict[str, float]] = {}
    for line in metrics_text.splitlines():
        match = re.match(r'^finetune_reconcile_seconds_(sum|count)\{planned="(\w+)"\}\s+([0-9.e+]+)$', line)
        if match:
            out.setdefault(match.group(2), {})[match.group(1)] = float(match.group(3))
    return {planned: {"count": v.get("count", 0), "mean_s": v.get("sum", 0) / v["count"] if v.get("count") else 0}
            for planned, v in out.items()}


def watch_delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    """The watches opened (or closed, negative) between two readings, by resource."""
    return {r: after.get(r, 0) - before.get(r, 0) for r in sorted(set(after) | set(before))
            if after.get(r, 0) != before.get(r, 0)}


def process_facts(pid: int) -> dict[str, Any]:
    status = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return {"rss_mib": int(status["VmRSS"].split()[0]) / 1024, "peak_rss_mib": int(status["VmHWM"].split()[0]) / 1024,
            "threads": int(status["Threads"]), "cpu_s": (int(stat[11]) + int(stat[12])) / ticks}


def api_connections(pid: int, port: int) -> int:
    """Established TCP connections of the process to `port` (the API server's), from /proc."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    count = 0
    for table in ("tcp", "tcp6"):
        path = Path(f"/proc/{pid}/net/{table}")
        if not path.exists():
            continue
        for line in path.read_text().splitlines()[1:]:
            fields = line.split()
            remote_port = int(fields[2].rsplit(":", 1)[1], 16)
            if fields[3] == "01" and remote_port == port and fields[9] in inodes:  # 01: ESTABLISHED
                count += 1
    return count


def measure_kopf_runner(lab: Any, kubeconfig: Path, workdir: Path, port: int) -> dict[str, Any]:
    """kopf with no resource handler, for 15 s: what it asks of the API server all the same."""
    import subprocess

    script = workdir / "kopf_runner.py"
    script.write_text(KOPF_RUNNER)
    before = watches_by_resource(lab)
    log_path = workdir / "kopf_runner.log"
    with open(log_path, "w") as log_file:
        proc = subprocess.Popen([sys.executable, str(script), str(kubeconfig)], stdout=log_file,
                                stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    try:
        time.sleep(15)
        if proc.poll() is not None:
            return {"error": f"kopf exited {proc.returncode}: {log_path.read_text()[-500:]}"}
        facts = process_facts(proc.pid)
        after = watches_by_resource(lab)
        watches = watch_delta(before, after)
        text = log_path.read_text()
        return {"watches": watches, "watch_count": sum(watches.values()), "api_connections": api_connections(proc.pid, port),
                "threads": facts["threads"], "rss_mib": facts["rss_mib"],
                "forbidden": sorted(set(re.findall(r"[Nn]ot enough permissions[^\n]*", text)))[:3]}
    finally:
        proc.kill()  # nothing of it needs a clean stop
        proc.wait(timeout=10)


def install_crd(lab: Any, source: Path) -> None:
    """A checkout's FineTuneJob CRD, applied and Established (`kubectl wait` fails at once on a CRD
    whose status has no conditions yet: ask until it has)."""
    from e2e.lab.waiting import wait_for

    lab.kubectl("apply", "--server-side", "-f", str(source / "crds" / "finetunejob.yaml"))
    wait_for(lambda: "True" in lab.kubectl("get", "crd/finetunejobs.finetune.dev", "-o",
                                           "jsonpath={.status.conditions[?(@.type=='Established')].status}",
                                           check=False).stdout, 60, "the FineTuneJob CRD Established")


def apply_jobs(lab: Any, args: argparse.Namespace, applied: dict[str, float], lock: threading.Lock) -> None:
    """--jobs FineTuneJobs, one every --interval seconds; `applied` gets when each create call returned."""
    from kubernetes import client

    creator = client.CustomObjectsApi(lab.api_client())
    for i in range(args.jobs):
        body = manifest(i)
        creator.create_namespaced_custom_object("finetune.dev", "v1alpha1", NAMESPACE, "finetunejobs", body,
                                                _preload_content=False)
        with lock:
            applied[body["metadata"]["name"]] = time.time()
        time.sleep(args.interval)


def manifest(index: int) -> dict[str, Any]:
    job = h.job_from_example("llama-8b-lora.yaml", f"job-{index:04d}", NAMESPACE,
                             rule={"true-peak-factor": "1.0", "run-duration": "5s"})
    job["spec"]["training"]["maxSteps"] = 20
    job["spec"].pop("checkpoint", None)
    job["spec"]["placement"] = {"regions": ["eu-de-berlin", "eu-fr-paris"]}
    job["spec"]["resources"]["gpuTypes"] = ["H100-80GB", "A100-40GB"]
    return job


def measure(source: Path, args: argparse.Namespace) -> dict[str, Any]:
    from kubernetes import client

    from e2e.lab.cluster import up
    from e2e.lab.waiting import wait_for

    # That checkout's chart (its RBAC) and operator code; the lab and this benchmark are this checkout's.
    h.CHART = source / "charts" / "finetune-operator"
    os.environ["PYTHONPATH"] = os.pathsep.join([str(source / "operator"), str(source / "images" / "trainer")])
    revision = os.popen(f"git -C {source} rev-parse --short HEAD").read().strip()
    dirty = bool(os.popen(f"git -C {source} status --porcelain -- operator charts").read().strip())
    workdir = Path(tempfile.mkdtemp(prefix="finetune-watch-stack-"))
    lab = up(die_with_parent=True)
    stop = threading.Event()
    operator: h.OperatorProcess | None = None
    try:
        install_crd(lab, source)
        h.install_chart(lab)
        api = lab.api_client()
        core = client.CoreV1Api(api)
        core.create_namespace({"metadata": {"name": NAMESPACE}})
        wait_for(lambda: core.read_namespaced_service_account("default", NAMESPACE), 60, "the default ServiceAccount")
        h.volumes(lab, NAMESPACE, ["models", "data"])
        applied: dict[str, float] = {}
        first_status: dict[str, float] = {}
        lock = threading.Lock()

        def on_job(kind: str, obj: dict) -> None:
            if kind != "DELETED" and (obj.get("status") or {}).get("phase"):
                with lock:
                    first_status.setdefault(obj["metadata"]["name"], time.time())

        watch = ch.ResourceWatch("finetunejobs", lab.api_client(), "finetunejobs", on_event=on_job,
                                 on_sync=lambda items: [on_job("ADDED", i) for i in items], stop=stop)
        watch.start()
        watch.synced.wait(30)
        time.sleep(2)
        # The lab's controllers open watches of their own a while after a CRD appears (the garbage
        # collector's discovery runs every 30 s): wait until the count holds still for 35 s.
        before = watches_by_resource(lab)
        for _ in range(4):
            time.sleep(35)
            settled, before = before, watches_by_resource(lab)
            if settled == before:
                break
        (workdir / "replica-0").mkdir()
        operator = h.OperatorProcess(lab, workdir / "replica-0")
        started = time.monotonic()
        operator.start()  # returns once /healthz answers 200
        healthy_s = time.monotonic() - started
        time.sleep(3)  # its informers have listed
        assert operator.proc is not None
        pid = operator.proc.pid
        port = int(lab.server.rsplit(":", 1)[1])
        cpu_before = process_facts(pid)["cpu_s"]
        apply_jobs(lab, args, applied, lock)
        wait_for(lambda: len(first_status) >= args.jobs, 120, "every job's first status")
        cpu_after = process_facts(pid)["cpu_s"]
        reconciles = reconcile_seconds(operator.metrics())
        time.sleep(10)
        facts = process_facts(pid)
        after = watches_by_resource(lab)
        operator_watches = watch_delta(before, after)
        with lock:
            latency = [first_status[name] - t for name, t in applied.items() if name in first_status]
        result = {
            "source": str(source), "revision": revision + ("+dirty" if dirty else ""), "jobs": args.jobs,
            "interval_s": args.interval, "start_to_healthy_s": healthy_s,
            "apply_to_first_status_s": {"p50": percentile(latency, 50), "p99": percentile(latency, 99),
                                        "max": max(latency, default=None)},
            "operator_cpu_s": cpu_after - cpu_before, "reconcile_seconds": reconciles,
            "watches": operator_watches,
            "api_connections": api_connections(pid, port),
            "threads": facts["threads"], "rss_mib": facts["rss_mib"], "peak_rss_mib": facts["peak_rss_mib"],
            "load_average": os.getloadavg(),
        }
        result["watch_count"] = sum(result["watches"].values())
        if args.kopf_runner:
            result["kopf_runner"] = measure_kopf_runner(lab, operator.kubeconfig, workdir, port)
        print(table([result]), flush=True)
        return result
    finally:
        stop.set()
        if operator is not None:
            operator.stop()
        lab.down()


def measure_paired(args: argparse.Namespace) -> dict[str, Any]:
    import asyncio
    import logging
    from functools import partial

    import kopf
    from kubernetes import client, config

    from e2e.lab.cluster import up
    from e2e.lab.waiting import wait_for
    from finetune_operator.shell.apiclient import bounded_client, client_configuration
    from finetune_operator.shell.informer import Informer

    lab = up(die_with_parent=True)
    seen: dict[str, dict[str, float]] = {"kopf": {}, "informer": {}}
    applied: dict[str, float] = {}
    lock = threading.Lock()
    stop = threading.Event()
    informer: Informer | None = None
    kopf_thread: threading.Thread | None = None

    def arrived(stack: str, name: str) -> None:
        with lock:
            seen[stack].setdefault(name, time.time())

    try:
        install_crd(lab, ROOT)
        client.CoreV1Api(lab.api_client()).create_namespace({"metadata": {"name": NAMESPACE}})
        kubeconfig = str(lab.kubeconfig)

        registry = kopf.OperatorRegistry()

        @kopf.on.startup(registry=registry)
        def configure(settings: kopf.OperatorSettings, **_: Any) -> None:  # as shell/handlers.py set it at 058e0df
            settings.posting.level = logging.WARNING
            settings.watching.server_timeout, settings.watching.client_timeout = 300, 330
            settings.watching.connect_timeout, settings.networking.request_timeout = 30, 60
            settings.batching.batch_window = 0.01
            settings.peering.standalone = True

        @kopf.on.login(registry=registry)
        def login(**_: Any) -> kopf.ConnectionInfo:
            cfg = client.Configuration()
            config.load_kube_config(config_file=kubeconfig, client_configuration=cfg)
            scheme, _, token = ((cfg.api_key or {}).get("BearerToken") or "").partition(" ")
            return kopf.ConnectionInfo(server=cfg.host, ca_path=cfg.ssl_ca_cert, scheme=scheme or None,
                                       token=token or None, certificate_path=cfg.cert_file,
                                       private_key_path=cfg.key_file)

        @kopf.on.event("finetune.dev", "v1alpha1", "finetunejobs", registry=registry)
        def on_event(event: dict[str, Any], name: str, **_: Any) -> None:
            if event.get("type") in (None, "ADDED"):
                arrived("kopf", name)

        ready = threading.Event()
        kopf_thread = threading.Thread(target=lambda: asyncio.run(kopf.operator(
            registry=registry, clusterwide=True, standalone=True, stop_flag=stop, ready_flag=ready)), daemon=True)
        kopf_thread.start()
        custom = client.CustomObjectsApi(bounded_client(client_configuration(kubeconfig)))
        informer = Informer("finetunejobs", partial(custom.list_cluster_custom_object, "finetune.dev", "v1alpha1",
                                                    "finetunejobs"),
                            on_change=lambda kind, obj: kind == "ADDED" and arrived("informer", obj["metadata"]["name"]))
        informer.start()
        if not (ready.wait(60) and informer.synced.wait(60)):
            raise RuntimeError("kopf or the informer did not start")
        time.sleep(5)  # kopf's watch is open
        apply_jobs(lab, args, applied, lock)
        wait_for(lambda: all(len(seen[stack]) >= args.jobs for stack in seen), 60, "every job seen by both stacks")
        result: dict[str, Any] = {"jobs": args.jobs, "interval_s": args.interval, "load_average": os.getloadavg()}
        for stack in seen:
            latency = [seen[stack][name] - t for name, t in applied.items()]
            result[stack] = {"p50": percentile(latency, 50), "p99": percentile(latency, 99), "max": max(latency)}
        difference = [seen["kopf"][name] - seen["informer"][name] for name in applied]
        result["kopf_minus_informer"] = {"p50": percentile(difference, 50), "p1": percentile(difference, 1),
                                         "p99": percentile(difference, 99)}
        return result
    finally:
        stop.set()
        if informer is not None:
            informer.stop()
        if kopf_thread is not None:
            kopf_thread.join(15)
        lab.down()


def paired_table(result: dict[str, Any]) -> str:
    def ms(values: dict[str, float], keys: tuple[str, ...] = ("p50", "p99", "max")) -> str:
        return " / ".join(f"{values[k] * 1000:.1f} ms" for k in keys)

    return "\n".join([
        f"{result['jobs']} FineTuneJobs, one every {result['interval_s']} s; apply -> handler, p50 / p99 / max",
        f"  kopf (aiohttp)                 {ms(result['kopf'])}",
        f"  informer (Kubernetes client)   {ms(result['informer'])}",
        f"  kopf - informer, per job       p50 {ms(result['kopf_minus_informer'], ('p50',))}, "
        f"p1 {ms(result['kopf_minus_informer'], ('p1',))}, p99 {ms(result['kopf_minus_informer'], ('p99',))}",
    ])


def table(results: list[dict[str, Any]]) -> str:
    rows = [("", *[r["revision"] for r in results])]

    def row(label: str, fn: Any) -> None:
        rows.append((label, *[fn(r) for r in results]))

    def seconds(value: float | None) -> str:
        return "-" if value is None else f"{value * 1000:.0f} ms" if value < 10 else f"{value:.1f} s"

    row("apply -> first status, p50 / p99 / max", lambda r: " / ".join(
        seconds(r["apply_to_first_status_s"][k]) for k in ("p50", "p99", "max")))
    row("operator CPU while applying", lambda r: f"{r['operator_cpu_s']:.1f} s")
    row("reconciles: count, mean (planned / not)", lambda r: " / ".join(
        f"{v['count']:.0f}, {v['mean_s'] * 1000:.0f} ms" for _, v in sorted(r["reconcile_seconds"].items(), reverse=True)))
    row("watches held for the operator", lambda r: f"{r['watch_count']} ({', '.join(f'{k} {v}' for k, v in r['watches'].items())})")
    row("API connections", lambda r: str(r["api_connections"]))
    row("threads", lambda r: str(r["threads"]))
    row("RSS / peak", lambda r: f"{r['rss_mib']:.0f} / {r['peak_rss_mib']:.0f} MiB")
    row("start -> healthy", lambda r: f"{r['start_to_healthy_s']:.1f} s")
    if any("kopf_runner" in r for r in results):
        def kopf(r: dict[str, Any]) -> str:
            k = r.get("kopf_runner") or {}
            if "watches" not in k:
                return k.get("error", "-")
            held = ", ".join(f"{name} {n}" for name, n in k["watches"].items())
            return (f"{k['watch_count']} watches ({held}), {k['api_connections']} connections, {k['threads']} threads, "
                    f"{k['rss_mib']:.0f} MiB" + (f"; {k['forbidden'][0]}" if k["forbidden"] else ""))

        row("kopf running the process only", kopf)
    width = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(str(cell).ljust(width[i]) for i, cell in enumerate(r)) for r in rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--source", type=Path, nargs="+", default=[ROOT], help="checkouts to measure, in order")
    parser.add_argument("--jobs", type=int, default=200)
    parser.add_argument("--interval", type=float, default=0.2, help="seconds between two applies")
    parser.add_argument("--kopf-runner", action="store_true", help="also measure kopf with no resource handler")
    parser.add_argument("--paired", action="store_true", help="measure the two watch stacks side by side instead")
    parser.add_argument("--json-out", type=Path, default=RESULTS / "watch_stack.json")
    args = parser.parse_args(argv)
    import logging

    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("urllib3").setLevel(logging.ERROR)
    args.json_out.parent.mkdir(parents=True, exist_ok=True)
    if args.paired:
        paired = measure_paired(args)
        print(paired_table(paired), flush=True)
        args.json_out.write_text(json.dumps({"cpus": os.cpu_count(), "paired": paired}, indent=2) + "\n")
        return 0
    results = [measure(source.resolve(), args) for source in args.source]
    print(table(results), flush=True)
    args.json_out.write_text(json.dumps({"cpus": os.cpu_count(), "results": results}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

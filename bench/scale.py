"""Scale benchmark: many FineTuneJobs applied at once on the lab, and the operator's failover.

    python bench/scale.py [--jobs 300 1000] [--run-seconds 20] [--deadline 420] [--margin 1.0] [--backlog]
                          [--unschedulable-timeout 30] [--failover] [--json-out bench/results/scale.json]

Run it under the lab lock: `flock /tmp/lab.lock python bench/scale.py ...`.

For each job count it starts its own lab (real etcd, kube-apiserver, scheduler, kwok, the Kubeflow
training operator, the fake GPU; pools as e2e/lab/pools.yaml: 16 H100-80GB in eu-de-berlin, 16
A100-40GB in eu-fr-paris, 16 H100-80GB in us-east-virginia outside the allowed regions), installs
the chart (policy: the chart's, with startTimeCostMargin --margin and unschedulableTimeoutSeconds
--unschedulable-timeout) and runs the operator as the chart's ServiceAccount (e2e/operator_harness.py).
Then it creates N FineTuneJobs at once from 8 client threads (examples/llama-8b-lora.yaml, LoRA 8B,
20 steps, each run --run-seconds long on the fake GPU; half allowed in eu-de-berlin only on
H100-80GB, half in eu-de-berlin and eu-fr-paris on H100-80GB or A100-40GB), spread over 4
namespaces, and watches FineTuneJobs, PyTorchJobs and training pods until every job is
terminal or --deadline passes.

Figures (goals from issue 17):
  apply -> child      time from the create call's return to the job's first PyTorchJob seen by
                      the benchmark's watch, p50/p99 (goal p99 < 2 s at 1000 jobs)
  plans per second    jobs given their first PyTorchJob / seconds from the first create call to the last
                      first PyTorchJob (every job of the burst is planned and given its child at
                      once, placed or waiting for its pool); bounded by the apply rate (about 25/s
                      from 8 threads here) unless --backlog: every job created before the operator
                      starts, counted from its start (apply -> child is then from that start too)
  apply -> Succeeded  time to phase Succeeded, p50/p99 over the jobs that finished by the deadline
  plans by pool       the pool of every attempt's PyTorchJob (its plan-status annotation)
  pods Running/Pending at most
  GPU utilisation while work waits: busy GPUs (requested by Running training pods; also: held by
                      pods bound to a node, which kwok may report Running late) / the 32
                      allowed GPUs, sampled every second while some job waits (applied, not
                      terminal, no Running pod) and after the first child exists (goal >= 90%)
  operator peak RSS   VmHWM of the operator process (goal < 200 MiB at 1000 jobs)
  failover (--failover, on the first job count's lab after its jobs): a second replica joins,
                      the leader is SIGKILLed, a job is applied; seconds from the kill to that
                      job's PyTorchJob (goal < 5 s)
Writes every figure to --json-out and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from e2e import chaos as ch  # noqa: E402
from e2e import operator_harness as h  # noqa: E402

RESULTS = ROOT / "bench" / "results"
ALLOWED_GPUS = 32  # 16 H100-80GB in eu-de-berlin + 16 A100-40GB in eu-fr-paris (e2e/lab/pools.yaml)
NAMESPACES = ("scale-a", "scale-b", "scale-c", "scale-d")
PLAN_STATUS_ANNOTATION = "finetune.dev/plan-status"
JOB_LABEL = "finetune.dev/job"
TERMINAL = ("Succeeded", "Failed")


def now() -> float:
    return time.monotonic()


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def manifest(index: int, run_seconds: int) -> tuple[str, dict[str, Any]]:
    namespace = NAMESPACES[index % len(NAMESPACES)]
    name = f"job-{index:04d}"
    job = h.job_from_example("llama-8b-lora.yaml", name, namespace,
                             rule={"true-peak-factor": "1.0", "run-duration": f"{run_seconds}s"})
    spec = job["spec"]
    spec["training"]["maxSteps"] = 20
    spec.pop("checkpoint", None)
    if index % 2:
        spec["placement"] = {"regions": ["eu-de-berlin", "eu-fr-paris"]}
        spec["resources"]["gpuTypes"] = ["H100-80GB", "A100-40GB"]
    else:
        spec["placement"] = {"regions": ["eu-de-berlin"]}
        spec["resources"]["gpuTypes"] = ["H100-80GB"]
    return namespace, job


class Observer:
    """What the watches saw, timed on this process's clock."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.applied: dict[tuple[str, str], float] = {}
        self.first_child: dict[tuple[str, str], float] = {}
        self.succeeded: dict[tuple[str, str], float] = {}
        self.phase: dict[tuple[str, str], str] = {}
        self.children: dict[str, str] = {}  # child uid -> pool
        self.pods: dict[str, tuple[tuple[str, str], str, int, bool]] = {}  # pod uid -> (job, phase, GPUs, bound)

    @staticmethod
    def listed(on_event: Any) -> Any:
        """A list's items as ADDED events (a first sighting is timed when the list is read: later
        than it happened, never earlier)."""
        return lambda items: [on_event("ADDED", item) for item in items]

    def pods_listed(self, items: list[dict]) -> None:
        """The pods a list shows replace those seen (pods deleted between two watches go)."""
        with self.lock:
            self.pods.clear()
        for item in items:
            self.on_pod("ADDED", item)

    def on_child(self, kind: str, obj: dict) -> None:
        meta = obj.get("metadata") or {}
        job = (meta.get("namespace"), (meta.get("labels") or {}).get(JOB_LABEL))
        with self.lock:
            if kind != "DELETED":
                self.first_child.setdefault(job, now())
                if meta.get("uid") not in self.children:
                    try:
                        plan = json.loads((meta.get("annotations") or {}).get(PLAN_STATUS_ANNOTATION) or "{}")
                    except ValueError:
                        plan = {}
                    self.children[meta.get("uid")] = plan.get("nodePool") or "?"

    def on_job(self, kind: str, obj: dict) -> None:
        meta = obj.get("metadata") or {}
        key = (meta.get("namespace"), meta.get("name"))
        phase = (obj.get("status") or {}).get("phase") or ""
        with self.lock:
            self.phase[key] = phase
            if phase == "Succeeded":
                self.succeeded.setdefault(key, now())

    def on_pod(self, kind: str, obj: dict) -> None:
        meta = obj.get("metadata") or {}
        job = (meta.get("namespace"), (meta.get("labels") or {}).get(JOB_LABEL))
        gpus = 0
        for container in (obj.get("spec") or {}).get("containers") or []:
            limits = (container.get("resources") or {}).get("limits") or {}
            gpus += int(limits.get("nvidia.com/gpu", 0) or 0)
        with self.lock:
            if kind == "DELETED":
                self.pods.pop(meta.get("uid"), None)
            else:
                self.pods[meta.get("uid")] = (job, (obj.get("status") or {}).get("phase") or "Pending", gpus,
                                              bool((obj.get("spec") or {}).get("nodeName")))

    def sample(self) -> dict[str, Any]:
        with self.lock:
            running_jobs = {job for job, phase, _, _ in self.pods.values() if phase == "Running"}
            busy = sum(gpus for _, phase, gpus, _ in self.pods.values() if phase == "Running")
            # Held by a pod on a node (scheduled, not finished): what the scheduler counts; the lab's
            # kwok may take a while to report a bound pod Running on a loaded machine.
            held = sum(gpus for _, phase, gpus, bound in self.pods.values() if bound and phase not in TERMINAL)
            running = sum(1 for _, phase, _, _ in self.pods.values() if phase == "Running")
            pending = sum(1 for _, phase, _, _ in self.pods.values() if phase == "Pending")
            waiting = sum(1 for key in self.applied if self.phase.get(key) not in TERMINAL and key not in running_jobs)
            done = sum(1 for key in self.applied if self.phase.get(key) in TERMINAL)
            return {"busy": busy, "held": held, "running": running, "pending": pending, "waiting": waiting, "done": done,
                    "children": len(self.first_child)}


class RssSampler(threading.Thread):
    def __init__(self, pid_of: Any, stop: threading.Event) -> None:
        super().__init__(daemon=True)
        self.pid_of, self.stop = pid_of, stop
        self.peak_kib = 0

    def run(self) -> None:
        while not self.stop.wait(0.5):
            pid = self.pid_of()
            if pid is None:
                continue
            try:
                for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                    if line.startswith("VmHWM:"):
                        self.peak_kib = max(self.peak_kib, int(line.split()[1]))
            except OSError:
                pass


def run_scale(jobs: int, args: argparse.Namespace, *, failover: bool) -> dict[str, Any]:
    from kubernetes import client

    from e2e.lab.cluster import up
    from e2e.lab.waiting import wait_for

    workdir = Path(tempfile.mkdtemp(prefix=f"finetune-scale-{jobs}-"))
    t0 = now()
    lab = up(die_with_parent=True)
    stop = threading.Event()
    operators: list[h.OperatorProcess] = []
    result: dict[str, Any] = {"jobs": jobs, "run_seconds": args.run_seconds, "workdir": str(workdir)}
    try:
        lab.kubectl("apply", "--server-side", "-f", str(ROOT / "crds" / "finetunejob.yaml"))
        # `kubectl wait` fails at once on a CRD whose status has no conditions yet: ask until it has.
        wait_for(lambda: "True" in lab.kubectl("get", "crd/finetunejobs.finetune.dev", "-o",
                                               "jsonpath={.status.conditions[?(@.type=='Established')].status}",
                                               check=False).stdout, 60, "the FineTuneJob CRD Established")
        h.install_chart(lab, "--set-json", f"policy.startTimeCostMargin={args.margin}",
                        "--set-json", f"policy.unschedulableTimeoutSeconds={args.unschedulable_timeout}")
        api = lab.api_client()
        core = client.CoreV1Api(api)
        for ns in NAMESPACES:
            core.create_namespace({"metadata": {"name": ns}})
            wait_for(lambda: core.read_namespaced_service_account("default", ns), 60, f"ServiceAccount {ns}/default")
            h.volumes(lab, ns, ["models", "data"])
        seen = Observer()
        # A watch the server ends resumes from its last resourceVersion; only an error lists again, and
        # then what the list shows counts too (a child created while no watch ran is still seen).
        watches = [
            ch.ResourceWatch("pytorchjobs", lab.api_client(), "pytorchjobs", label_selector=JOB_LABEL,
                             on_event=seen.on_child, on_sync=seen.listed(seen.on_child), stop=stop),
            ch.ResourceWatch("finetunejobs", lab.api_client(), "finetunejobs", on_event=seen.on_job,
                             on_sync=seen.listed(seen.on_job), stop=stop),
            ch.ResourceWatch("pods", lab.api_client(), "pods", label_selector=JOB_LABEL, on_event=seen.on_pod,
                             on_sync=seen.pods_listed, stop=stop),
        ]
        for w in watches:
            w.start()
        for w in watches:
            w.synced.wait(30)
        (workdir / "replica-0").mkdir()
        operator = h.OperatorProcess(lab, workdir / "replica-0", tuple(args.operator_args.split()))
        operators.append(operator)
        rss = RssSampler(lambda: operator.proc.pid if operator.proc and operator.proc.poll() is None else None, stop)

        def start_operator() -> None:
            operator.start()
            rss.start()
            print(f"[{jobs}] lab, chart and operator ready in {now() - t0:.0f} s; operator log {operator.log_path}",
                  flush=True)

        if not args.backlog:
            start_operator()
        documents = [manifest(i, args.run_seconds) for i in range(jobs)]
        creator = client.CustomObjectsApi(lab.api_client())

        def create(item: tuple[str, dict[str, Any]]) -> None:
            namespace, body = item
            creator.create_namespaced_custom_object("finetune.dev", "v1alpha1", namespace, "finetunejobs", body,
                                                    _preload_content=False)
            with seen.lock:
                seen.applied[(namespace, body["metadata"]["name"])] = now()

        t_apply = now()
        samples: list[dict[str, Any]] = []
        sampling = threading.Event()

        def sampler() -> None:
            while not sampling.wait(1.0):
                sample = seen.sample()
                sample["t"] = now() - t_apply
                samples.append(sample)

        threading.Thread(target=sampler, daemon=True).start()
        with ThreadPoolExecutor(max_workers=8) as pool:
            list(pool.map(create, documents))
        apply_seconds = now() - t_apply
        print(f"[{jobs}] created {jobs} FineTuneJobs in {apply_seconds:.1f} s", flush=True)
        if args.backlog:
            # Every job waits before the operator starts: its planning rate, not the apply rate, is measured.
            t_start = now()
            start_operator()
            t_apply = t_start  # the figures count from the operator's start
            with seen.lock:
                seen.applied = {key: t_start for key in seen.applied}
        deadline = t_apply + args.deadline
        last = 0.0
        while now() < deadline:
            sample = seen.sample()
            if sample["done"] >= jobs or (args.backlog and sample["children"] >= jobs):
                break
            if now() - last > 15:
                last = now()
                print(f"[{jobs}] t={now() - t_apply:.0f}s children {sample['children']} running {sample['running']}"
                      f" pending {sample['pending']} waiting {sample['waiting']} done {sample['done']}", flush=True)
            time.sleep(1)
        sampling.set()
        elapsed = now() - t_apply
        with seen.lock:
            to_child = [seen.first_child[k] - t for k, t in seen.applied.items() if k in seen.first_child]
            # apply -> child by when the job was applied (tenths of the apply): where the tail lies
            order = sorted((t, seen.first_child[k] - t) for k, t in seen.applied.items() if k in seen.first_child)
            tenth = max(1, len(order) // 10)
            by_tenth = [round(percentile([d for _, d in order[i:i + tenth]], 99) or 0, 2)
                        for i in range(0, len(order), tenth)]
            first_apply = min(seen.applied.values(), default=None)  # with --backlog: the operator's start
            last_child = max((seen.first_child[k] for k in seen.applied if k in seen.first_child), default=None)
            plans_per_second = (len(order) / (last_child - first_apply)
                                if order and last_child is not None and last_child > first_apply else None)
            to_done = [seen.succeeded[k] - t for k, t in seen.applied.items() if k in seen.succeeded]
            phases: dict[str, int] = {}
            for key in seen.applied:
                phases[seen.phase.get(key) or "?"] = phases.get(seen.phase.get(key) or "?", 0) + 1
            by_pool: dict[str, int] = {}
            for pool_name in seen.children.values():
                by_pool[pool_name] = by_pool.get(pool_name, 0) + 1
        waiting_samples = [s for s in samples if s["waiting"] > 0 and s["children"] > 0]
        utilisation = [min(1.0, s["busy"] / ALLOWED_GPUS) for s in waiting_samples]
        held = [min(1.0, s["held"] / ALLOWED_GPUS) for s in waiting_samples]
        result.update({
            "apply_seconds": apply_seconds,
            "elapsed_seconds": elapsed,
            "with_child": len(to_child),
            "apply_to_child_s": {"p50": percentile(to_child, 50), "p99": percentile(to_child, 99), "max": max(to_child, default=None),
                                 "p99_by_tenth_of_the_apply": by_tenth},
            "plans_per_second": plans_per_second,
            "succeeded": len(to_done),
            "apply_to_succeeded_s": {"p50": percentile(to_done, 50), "p99": percentile(to_done, 99)},
            "phases_at_end": phases,
            "plans_by_pool": by_pool,
            "pods_running_max": max((s["running"] for s in samples), default=0),
            "pods_pending_max": max((s["pending"] for s in samples), default=0),
            "utilisation_while_waiting": {"mean": statistics.mean(utilisation) if utilisation else None,
                                          "p10": percentile(utilisation, 10), "samples": len(utilisation)},
            "gpus_held_while_waiting": {"mean": statistics.mean(held) if held else None, "p10": percentile(held, 10)},
            "operator_peak_rss_mib": rss.peak_kib / 1024,
            "load_average": os.getloadavg(),
        })
        print(table([result]), flush=True)
        if failover:
            try:
                result["failover"] = measure_failover(lab, workdir, operator, operators)
            except Exception as error:  # noqa: BLE001 - the figures above stand; say what failed
                result["failover"] = {"error": repr(error)}
        return result
    finally:
        stop.set()
        for operator in operators:
            try:
                operator.stop()
            except Exception:  # noqa: BLE001 - stopping what is left
                pass
        lab.down()


def measure_failover(lab: Any, workdir: Path, leader: h.OperatorProcess, operators: list[h.OperatorProcess]) -> dict[str, Any]:
    """A second replica joins; the leader is SIGKILLed; a job applied right after: seconds to its PyTorchJob."""
    from kubernetes import client
    from kubernetes.client.rest import ApiException

    from e2e.lab.waiting import wait_for

    coordination = client.CoordinationV1Api(lab.api_client())

    def holder() -> str | None:
        try:
            lease = coordination.read_namespaced_lease("finetune-operator", h.RELEASE_NAMESPACE)
        except ApiException:
            return None
        return lease.spec.holder_identity

    (workdir / "replica-1").mkdir(exist_ok=True)
    standby = h.OperatorProcess(lab, workdir / "replica-1", leader.extra_args)
    operators.append(standby)
    standby.start()
    by_identity = {leader.identity: leader, standby.identity: standby}
    current = wait_for(lambda: holder() if holder() in by_identity else None, 30, "a replica to hold the Lease")
    active = by_identity[current]
    other = standby if active is leader else leader
    time.sleep(2)  # the standby's informers have listed
    namespace, probe = manifest(99999, 5)
    probe["metadata"]["name"] = "failover-probe"
    killed = now()
    active.kill()
    lab.kubectl("apply", "-f", "-", input=json.dumps(probe))
    wait_for(lambda: holder() == other.identity, 30, "the standby to take the Lease", interval=0.05)
    took_lease = now() - killed
    wait_for(lambda: h.pytorch_jobs(lab, namespace, "failover-probe"), 30, "the probe's PyTorchJob", interval=0.05)
    acted = now() - killed
    print(f"failover: Lease taken {took_lease:.2f} s, probe's PyTorchJob {acted:.2f} s after SIGKILL of the leader",
          flush=True)
    return {"lease_taken_s": took_lease, "acted_s": acted}


def fmt(value: Any, unit: str = "s") -> str:
    return "-" if value is None else f"{value:.1f}{unit}" if isinstance(value, float) else f"{value}{unit}"


def table(results: list[dict[str, Any]]) -> str:
    rows = [("", *[f"{r['jobs']} jobs" for r in results])]

    def row(label: str, fn: Any) -> None:
        rows.append((label, *[fn(r) for r in results]))

    row("apply -> PyTorchJob, p50 / p99", lambda r: f"{fmt(r['apply_to_child_s']['p50'])} / {fmt(r['apply_to_child_s']['p99'])}"
        f" ({r['with_child']}/{r['jobs']})")
    row("plans per second (first children)", lambda r: fmt(r.get("plans_per_second"), "/s"))
    row("apply -> Succeeded, p50 / p99", lambda r: f"{fmt(r['apply_to_succeeded_s']['p50'])} / "
        f"{fmt(r['apply_to_succeeded_s']['p99'])} ({r['succeeded']}/{r['jobs']} by {r['elapsed_seconds']:.0f}s)")
    row("plans by pool", lambda r: ", ".join(f"{k} {v}" for k, v in sorted(r["plans_by_pool"].items())))
    row("training pods Running / Pending at most", lambda r: f"{r['pods_running_max']} / {r['pods_pending_max']}")
    row("GPU utilisation while work waits", lambda r: "-" if r["utilisation_while_waiting"]["mean"] is None else
        f"{r['utilisation_while_waiting']['mean']:.0%} mean, {r['utilisation_while_waiting']['p10']:.0%} p10"
        f" ({r['utilisation_while_waiting']['samples']} samples)")
    row("GPUs held by scheduled pods while work waits", lambda r: "-" if not r.get("gpus_held_while_waiting", {}).get("mean")
        else f"{r['gpus_held_while_waiting']['mean']:.0%} mean, {r['gpus_held_while_waiting']['p10']:.0%} p10")
    row("operator peak RSS", lambda r: f"{r['operator_peak_rss_mib']:.0f} MiB")
    row("failover (SIGKILL leader -> child)", lambda r: f"{r['failover']['acted_s']:.2f} s (Lease {r['failover']['lease_taken_s']:.2f} s)"
        if r.get("failover", {}).get("acted_s") is not None else (r.get("failover") or {}).get("error", "-"))
    width = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(str(cell).ljust(width[i]) for i, cell in enumerate(r)) for r in rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, nargs="+", default=[300, 1000])
    parser.add_argument("--run-seconds", type=int, default=20)
    parser.add_argument("--deadline", type=float, default=420.0, help="seconds after the apply to stop waiting")
    parser.add_argument("--margin", type=float, default=1.0, help="policy startTimeCostMargin")
    parser.add_argument("--unschedulable-timeout", type=int, default=30, help="policy unschedulableTimeoutSeconds")
    parser.add_argument("--failover", action="store_true", help="measure failover on the first job count's lab")
    parser.add_argument("--backlog", action="store_true",
                        help="create every job before the operator starts; plans per second then count from its"
                             " start (with --jobs 1000: the operator's planning rate, which the apply rate bounds"
                             " otherwise, about 25 jobs/s from 8 client threads here)")
    parser.add_argument("--operator-args", default="", help="more `finetune-operator run` flags, e.g. '--workers 8'")
    parser.add_argument("--json-out", type=Path, default=RESULTS / "scale.json")
    args = parser.parse_args(argv)
    import logging

    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("urllib3").setLevel(logging.ERROR)
    source = os.popen(f"git -C {ROOT} rev-parse --short HEAD").read().strip()
    dirty = bool(os.popen(f"git -C {ROOT} status --porcelain -- operator").read().strip())
    results = []
    for i, jobs in enumerate(args.jobs):
        results.append(run_scale(jobs, args, failover=args.failover and i == 0))
        print(table(results), flush=True)
    document = {"source": source + ("+dirty" if dirty else ""), "cpus": os.cpu_count(),
                "settings": {"run_seconds": args.run_seconds, "deadline_s": args.deadline, "margin": args.margin,
                             "unschedulable_timeout_s": args.unschedulable_timeout,
                             "operator_args": args.operator_args},
                "results": results}
    args.json_out.parent.mkdir(parents=True, exist_ok=True)
    args.json_out.write_text(json.dumps(document, indent=2) + "\n")
    print(f"wrote {args.json_out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

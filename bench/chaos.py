"""Chaos benchmark: FineTuneJob lifecycles on the lab cluster while the world misbehaves.

    python bench/chaos.py [--jobs 50] [--kills 20] [--apiserver-restarts 2] [--seed 1] [--deadline 1800]
    python -m bench.chaos ...        (the same, from the repository root)

It starts its own lab (real etcd, kube-apiserver, scheduler, controller-manager, kwok, the
Kubeflow training operator, the fake GPU), installs the Helm chart and runs the operator as a
local process authenticated as the chart's ServiceAccount (as e2e/demo.py does), then runs
`--jobs` small FineTuneJobs (8B LoRA, short fake-GPU runs) over several namespaces, each with
an injected fate (submitted paced by the kills, at most `--concurrency` at once, so jobs arrive
over the whole fault phase), while:

- the operator is SIGKILLed at random moments (`--kills`) and started again;
- the kube-apiserver is stopped and started again on the same port and etcd (`--apiserver-restarts`);
- statuses of running jobs are patched: `currentAttempt: null`, an unknown key in every
  `attempts[]` entry, an unknown top-level status key (the installed CRD is made to keep
  unknown status fields, as a newer CRD would, unless `--prune-unknown-status`);
- foreign objects with clashing names (a ConfigMap `<job>-a1`, a PyTorchJob `<job>-a2`, not
  owned by the job) exist before the job is applied;
- jobs with `spec.queueName` get their PyTorchJob suspended at creation by a mutating webhook
  and admitted (suspend set to false) after a hold, the way Kueue does;
- training pods are evicted through the Eviction API or deleted.

Fates (fake GPU rules) and the terminal phase each must reach:

| fate | rule | expected |
|---|---|---|
| succeed | true peak = estimate | Succeeded |
| gpu-oom-once | true peak 1.7 x estimate: the first plan OOMs, a recovered one fits | Succeeded |
| gpu-oom-always | every attempt dies of a GPU OOM (maxAttempts 2) | Failed |
| host-oom-once | attempt 1 is OOM-killed (exit 137), later ones fit | Succeeded |
| host-oom-always | every attempt is OOM-killed (maxAttempts 2) | Failed |
| evicted-once | attempt 1 is evicted by the kubelet for node pressure | Succeeded |
| api-evict | a running pod is evicted through the Eviction API | Succeeded |
| delete-pod | a running pod is deleted | Succeeded |
| data-error | exit 1 with a data error message: not retryable | Failed |
| queued | spec.queueName: the child is queued, then admitted | Succeeded |
| queued-oom-once | queued, and the first plan OOMs | Succeeded |
| clash-cm-a1 | a foreign ConfigMap `<job>-a1` exists | Blocked: a condition names it, never adopted |
| clash-pj-a2 | a foreign PyTorchJob `<job>-a2` exists; attempt 1 OOMs | Blocked: a condition names it, never deleted |

Figures (goals): duplicate training jobs (more than one live PyTorchJob for one FineTuneJob
at any watch event: 0), attempt numbers that went backwards (0), jobs lost or stuck at the
deadline (0), foreign objects touched (modified, deleted, replaced or adopted: 0), children
un-suspended by anyone but the queue before admission (0), jobs in the expected terminal
state (100%), and the time from the last fault to a settled cluster (every job terminal or
blocked as expected, no live child of a finished job, no child waiting for admission).

Deterministic given --seed (fates, names, targets, kill gaps, restart points, queue holds);
what the operator does in between depends on timing. Writes every check's details to
bench/results/chaos.json (`--json-out`), keeps the operator log (path printed), and stops the lab.
Exit status 0 when every goal holds.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import re
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from e2e import chaos as ch  # noqa: E402
from e2e import operator_harness as h  # noqa: E402
from e2e.lab.waiting import wait_crd_established  # noqa: E402

RESULTS = ROOT / "bench" / "results"


# ---------------------------------------------------------------------------
# fates
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Fate:
    name: str
    rule: dict[str, str]
    expect: str  # Succeeded | Failed | Blocked
    max_attempts: int = 4
    queue: bool = False
    clash: tuple[str, str] | None = None  # (kind, attempt suffix) of a foreign object
    disrupt: str | None = None  # evict | delete
    weight: int = 1


FATES: tuple[Fate, ...] = (
    Fate("succeed", {"true-peak-factor": "1.0"}, "Succeeded", weight=3),
    Fate("gpu-oom-once", {"true-peak-factor": "1.7"}, "Succeeded", weight=3),
    Fate("gpu-oom-always", {"outcome": "gpu-oom"}, "Failed", max_attempts=2),
    Fate("host-oom-once", {"outcome-by-attempt": "host-oom,auto"}, "Succeeded"),
    Fate("host-oom-always", {"outcome": "host-oom"}, "Failed", max_attempts=2),
    Fate("evicted-once", {"outcome-by-attempt": "evicted,auto"}, "Succeeded"),
    Fate("api-evict", {"true-peak-factor": "1.0", "run-duration": "8s"}, "Succeeded", disrupt="evict"),
    Fate("delete-pod", {"true-peak-factor": "1.0", "run-duration": "8s"}, "Succeeded", disrupt="delete"),
    Fate("data-error", {"outcome": "fail", "fail-message": "ValueError: support/train.jsonl line 17: not valid JSON"},
         "Failed"),
    Fate("queued", {"true-peak-factor": "1.0"}, "Succeeded", queue=True, weight=2),
    Fate("queued-oom-once", {"true-peak-factor": "1.7"}, "Succeeded", queue=True),
    Fate("clash-cm-a1", {"true-peak-factor": "1.0"}, "Blocked", clash=("ConfigMap", "a1")),
    Fate("clash-pj-a2", {"true-peak-factor": "1.7"}, "Blocked", clash=("PyTorchJob", "a2")),
)
FATE_BY_NAME = {f.name: f for f in FATES}
STATUS_FAULTS = ("current-attempt-null", "attempt-extra-key", "unknown-status-key")
SHORT = {"succeed": "ok", "gpu-oom-once": "gpuoom1", "gpu-oom-always": "gpuoomx", "host-oom-once": "hostoom1",
         "host-oom-always": "hostoomx", "evicted-once": "evict1", "api-evict": "apievict", "delete-pod": "podgone",
         "data-error": "dataerr", "queued": "queued", "queued-oom-once": "queuedoom", "clash-cm-a1": "clashcm",
         "clash-pj-a2": "clashpj"}


@dataclass
class JobPlan:
    index: int
    namespace: str
    name: str
    fate: Fate
    status_fault: str | None = None
    rule: dict[str, str] = field(default_factory=dict)
    submitted_at: float | None = None
    status_fault_result: dict[str, Any] | None = None
    disrupted: dict[str, Any] | None = None
    foreign: Any = None

    @property
    def key(self) -> tuple[str, str]:
        return self.namespace, self.name

    @property
    def clash_name(self) -> str | None:
        return f"{self.name}-{self.fate.clash[1]}" if self.fate.clash else None


@dataclass
class Config:
    jobs: int = 50
    kills: int = 20
    apiserver_restarts: int = 2
    seed: int = 1
    namespaces: int = 3
    concurrency: int = 12
    gap_min: float = 4.0
    gap_max: float = 20.0
    deadline: float = 1800.0
    standalone: bool = False
    prune_unknown_status: bool = False
    json_out: Path | None = RESULTS / "chaos.json"
    keep_lab: bool = False
    operator_rev: str | None = None  # run the operator, CRD and chart of this git revision, not the working tree


def plan_jobs(cfg: Config, rng: random.Random) -> list[JobPlan]:
    """Every fate once (when there are enough jobs), the rest drawn by weight; shuffled; then
    the status faults spread over jobs that run (not the clash jobs)."""
    fates = list(FATES)[: cfg.jobs]
    weighted = [f for f in FATES for _ in range(f.weight)]
    fates += [rng.choice(weighted) for _ in range(cfg.jobs - len(fates))]
    rng.shuffle(fates)
    namespaces = [f"chaos-{chr(ord('a') + i)}" for i in range(cfg.namespaces)]
    plans = [JobPlan(i, namespaces[i % len(namespaces)], f"c{i:02d}-{SHORT[f.name]}", f) for i, f in enumerate(fates)]
    eligible = [p for p in plans if p.fate.clash is None and p.fate.disrupt is None]
    per_kind = max(1, round(cfg.jobs / 10))
    targets = rng.sample(eligible, min(len(eligible), per_kind * len(STATUS_FAULTS)))
    # currentAttempt: null hurts most on attempt 2: prefer jobs whose first attempt OOMs.
    targets.sort(key=lambda p: (0 if "oom-once" in p.fate.name else 1, p.index))
    for i, plan in enumerate(targets):
        plan.status_fault = STATUS_FAULTS[min(i // per_kind, len(STATUS_FAULTS) - 1)]
    for plan in plans:
        rule = {"run-duration": "2s", **plan.fate.rule}
        if plan.status_fault:
            rule["run-duration"] = "6s"  # long enough to be patched while it runs
        plan.rule = rule
    return plans


def job_manifest(plan: JobPlan) -> dict[str, Any]:
    job = h.job_from_example("llama-8b-lora.yaml", plan.name, plan.namespace, rule=plan.rule)
    job["spec"]["recovery"] = {"maxAttempts": plan.fate.max_attempts, "backoff": {"initialSeconds": 1, "maxSeconds": 2}}
    if plan.fate.queue:
        job["spec"]["queueName"] = "team-queue"
    job["metadata"].setdefault("labels", {})["chaos.finetune.dev/fate"] = plan.fate.name
    return job


# ---------------------------------------------------------------------------
# the run
# ---------------------------------------------------------------------------


class Faults:
    """Every fault injected, with its time (for 'time from the last fault to settled')."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.items: list[dict[str, Any]] = []

    def add(self, kind: str, **detail: Any) -> None:
        with self.lock:
            self.items.append({"kind": kind, "at": ch.now(), **detail})

    def count(self, kind: str) -> int:
        with self.lock:
            return sum(1 for f in self.items if f["kind"] == kind)

    def last(self) -> float | None:
        with self.lock:
            return max((f["at"] for f in self.items), default=None)


def say(message: str) -> None:
    print(f"[chaos {time.strftime('%H:%M:%S')}] {message}", flush=True)


class Chaos(threading.Thread):
    """Operator SIGKILLs at random moments, with kube-apiserver restarts spread between them."""

    def __init__(self, cfg: Config, rng: random.Random, lab: Any, operator: h.OperatorProcess, faults: Faults,
                 stop: threading.Event) -> None:
        super().__init__(name="chaos", daemon=True)
        self.cfg, self.rng, self.lab, self.operator, self.faults, self.stop_event = cfg, rng, lab, operator, faults, stop
        self.errors: list[str] = []
        self.finished = threading.Event()
        # Decided up front from the seed: the gap before each kill, the restart points and downtimes.
        self.gaps = [rng.uniform(cfg.gap_min, cfg.gap_max) for _ in range(cfg.kills)]
        # (before kill number i, downtime): spread evenly between the kills.
        self.restarts = [(round((j + 1) * cfg.kills / (cfg.apiserver_restarts + 1)), rng.uniform(1.0, 3.0))
                         for j in range(cfg.apiserver_restarts)]
        self.operator_lock = threading.Lock()
        self.paused_seconds = 0.0

    def run(self) -> None:
        try:
            pending_restarts = list(self.restarts)
            for i, gap in enumerate(self.gaps):
                if self.stop_event.wait(gap):
                    return
                while pending_restarts and pending_restarts[0][0] <= i and i > 0:
                    self._restart_apiserver(pending_restarts.pop(0)[1])
                    if self.stop_event.wait(self.rng.uniform(2.0, 5.0)):
                        return
                self._kill_operator(i + 1)
            for _, down in pending_restarts:  # --kills 0 (or 1): restarts after the kills
                if self.stop_event.wait(self.rng.uniform(self.cfg.gap_min, self.cfg.gap_max)):
                    return
                self._restart_apiserver(down)
        except Exception as exc:  # record, never hang the benchmark
            self.errors.append(repr(exc))
        finally:
            self.finished.set()

    def _kill_operator(self, n: int) -> None:
        with self.operator_lock:
            self.operator.kill()
            self.faults.add("operator-sigkill", n=n)
            say(f"operator SIGKILLed ({n}/{self.cfg.kills})")
            time.sleep(self.rng.uniform(0.0, 1.5))
            for attempt in (1, 2, 3):
                try:
                    self.operator.start()
                    break
                except Exception as exc:
                    self.errors.append(f"operator start {attempt}: {exc!r}"[:500])
                    self.operator.kill()
                    time.sleep(2)
            self._wait_active()

    def _wait_active(self, settle: float = 3.0, limit: float = 60.0) -> None:
        """A restarted operator may wait before it reconciles: kopf peering pauses it until the
        dead one's peering record expires (up to 30 s); a Lease-elected one waits until the dead
        leader's lease expires. The next gap starts when it works again, so kills land while it
        reconciles, not only while it waits. The wait is measured."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < limit and not self.stop_event.is_set():
            text = self.operator.logs()
            since_start = text[text.rfind("===== start"):]
            if "leads (lease" in since_start:
                break
            paused_at = since_start.rfind("Pausing operations")
            if paused_at >= 0 and since_start.rfind("Resuming operations") > paused_at:
                break
            waiting_for_lease = "lease" in since_start.lower()
            if paused_at < 0 and not waiting_for_lease and time.monotonic() - t0 >= settle:
                break
            time.sleep(0.25)
        waited = time.monotonic() - t0
        self.paused_seconds += max(0.0, waited - settle) if waited > settle else 0.0

    def _restart_apiserver(self, down_for: float) -> None:
        say(f"stopping the kube-apiserver for {down_for:.1f}s")
        self.faults.add("apiserver-restart-begin", down_for=round(down_for, 2))
        t = time.monotonic()
        self.lab.restart_apiserver(down_for=down_for)
        self.faults.add("apiserver-restart", down_for=round(down_for, 2), took=round(time.monotonic() - t, 1))
        say(f"kube-apiserver serving again after {time.monotonic() - t:.1f}s")


def use_operator_revision(rev: str, workdir: Path) -> Path:
    """Export the operator, trainer contract, CRD and chart of git revision `rev` (the working
    tree is left alone) and make the operator process import them; returns the CRD file."""
    import subprocess

    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", rev], capture_output=True, text=True, check=True).stdout.strip()
    dest = workdir / f"operator-{commit[:10]}"
    dest.mkdir()
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", commit, "operator", "images/trainer", "crds", "charts"],
                             capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(dest / "operator"), str(dest / "images" / "trainer"),
                                                             os.environ.get("PYTHONPATH")]))
    h.CHART = dest / "charts" / "finetune-operator"
    say(f"operator, CRD and chart of {rev} ({commit[:10]}) from {dest}")
    return dest / "crds" / "finetunejob.yaml"


def operator_usage() -> str:
    """`finetune-operator run --help` of the operator under test (flags differ across revisions)."""
    import subprocess

    return subprocess.run([sys.executable, "-m", "finetune_operator.cli", "run", "--help"],
                          capture_output=True, text=True).stdout


def operator_source(cfg: Config) -> str:
    import subprocess

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True).stdout.strip()

    if cfg.operator_rev:
        return f"{cfg.operator_rev} = {git('rev-parse', '--short', cfg.operator_rev)}"
    dirty = git("status", "--porcelain", "--", "operator", "crds", "charts", "images/trainer")
    return f"working tree at {git('rev-parse', '--short', 'HEAD')}" + (" with uncommitted operator changes" if dirty else "")


def run_benchmark(cfg: Config) -> dict[str, Any]:
    from kubernetes import client

    from e2e.lab.build import find_installation
    from e2e.lab.cluster import up

    if find_installation() is None:
        raise SystemExit("the lab's binaries are not built: run e2e/lab/build.sh")
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("urllib3").setLevel(logging.ERROR)  # retries while the apiserver restarts are expected
    rng = random.Random(cfg.seed)
    plans = plan_jobs(cfg, rng)
    chaos_rng = random.Random(f"{cfg.seed}:chaos")
    t_start = time.monotonic()
    workdir = Path(tempfile.mkdtemp(prefix="finetune-chaos-"))
    say(f"{cfg.jobs} jobs, {cfg.kills} operator kills, {cfg.apiserver_restarts} apiserver restarts, seed {cfg.seed}; "
        f"logs in {workdir}")
    source = operator_source(cfg)  # now: HEAD may move while the benchmark runs
    crd_file = h.REPO_ROOT / "crds" / "finetunejob.yaml"
    if cfg.operator_rev:
        crd_file = use_operator_revision(cfg.operator_rev, workdir)
    lab = up(die_with_parent=not cfg.keep_lab)
    stop = threading.Event()
    operator = None
    queue = None
    try:
        lab.kubectl("apply", "--server-side", "-f", str(crd_file))
        wait_crd_established(lab, "finetunejobs.finetune.dev")
        h.install_chart(lab)
        if not cfg.prune_unknown_status:
            ch.preserve_unknown_status_fields(lab)
        api = lab.api_client()
        core = client.CoreV1Api(api)
        custom = client.CustomObjectsApi(api)
        for ns in sorted({p.namespace for p in plans}):
            core.create_namespace({"metadata": {"name": ns}})
            from e2e.lab.waiting import wait_for
            wait_for(lambda: core.read_namespaced_service_account("default", ns), 60, f"ServiceAccount {ns}/default")
            h.volumes(lab, ns, ["models", "data", "checkpoints"])

        foreign = ch.ForeignObjects(lab.api_client())
        children = ch.ChildTracker(foreign.uids)
        jobs = ch.JobTracker()
        holds = random.Random(f"{cfg.seed}:queue")
        hold_of = {p.key: holds.uniform(3.0, 8.0) for p in plans}
        queue = ch.QueueSim(lab.api_client(), lambda ns, name: hold_of.get((ns, name.rsplit("-a", 1)[0]), 5.0), stop)
        children.listeners.append(queue.on_event)
        watches = [
            ch.ResourceWatch("pytorchjobs", lab.api_client(), "pytorchjobs", label_selector=ch.JOB_LABEL,
                             on_event=children.on_event, on_sync=children.on_sync, stop=stop),
            ch.ResourceWatch("finetunejobs", lab.api_client(), "finetunejobs", on_event=jobs.on_event,
                             on_sync=jobs.on_sync, stop=stop),
            ch.ResourceWatch("foreign-pytorchjobs", lab.api_client(), "pytorchjobs", label_selector=ch.FOREIGN_LABEL,
                             on_event=foreign.on_event("PyTorchJob"), stop=stop),
            ch.ResourceWatch("foreign-configmaps", lab.api_client(), "configmaps", label_selector=ch.FOREIGN_LABEL,
                             on_event=foreign.on_event("ConfigMap"), stop=stop),
        ]
        for w in watches:
            w.start()
        for w in watches:
            w.synced.wait(30)
        queue.start_webhook()

        usage = operator_usage()
        extra = (("--lease", "") if "--lease" in usage else ("--peering", "")) if cfg.standalone else ()
        operator = h.OperatorProcess(lab, workdir, extra_args=extra)
        if "--identity" not in usage:  # an operator from before the Lease election
            operator.identity = None
        operator.start()
        say(f"lab, chart, queue webhook and operator ready in {time.monotonic() - t_start:.0f}s; operator log {operator.log_path}")

        faults = Faults()
        chaos = Chaos(cfg, chaos_rng, lab, operator, faults, stop)
        t_faults = time.monotonic()
        chaos.start()
        deadline = t_faults + cfg.deadline
        pending = list(plans)
        settled_at: float | None = None
        last_report = 0.0
        loop_errors = 0

        def state_of(plan: JobPlan) -> str:
            hist = jobs.get(*plan.key)
            if hist is None:
                return "unseen"
            phase = hist.last.get("phase") or ""
            if phase in ch.TERMINAL:
                return phase
            if plan.fate.expect == "Blocked" and any(plan.clash_name in m for m in hist.messages):
                return "Blocked"
            return phase or "new"

        def settled(plan: JobPlan) -> bool:
            return plan.submitted_at is not None and state_of(plan) in ("Succeeded", "Failed", "Blocked")

        while True:
            t = time.monotonic()
            if t > deadline:
                say("deadline reached")
                break
            try:
                # submit
                in_flight = sum(1 for p in plans if p.submitted_at is not None and not settled(p))
                # Paced by the kills, so that jobs keep arriving over the whole fault phase
                # rather than finishing before most kills: job i waits for kill i*K/N.
                kills_done = faults.count("operator-sigkill")
                while pending and in_flight < cfg.concurrency and (
                        chaos.finished.is_set() or kills_done >= (pending[0].index * cfg.kills) // max(cfg.jobs, 1)):
                    plan = pending[0]
                    if plan.fate.clash and plan.foreign is None:
                        kind, suffix = plan.fate.clash
                        plan.foreign = foreign.create(kind, plan.namespace, f"{plan.name}-{suffix}", plan.name)
                        faults.add("foreign-object", object_kind=kind, name=plan.foreign.name)
                    lab.kubectl("apply", "-f", "-", input=json.dumps(job_manifest(plan)))  # volumes exist per namespace
                    plan.submitted_at = time.monotonic()
                    pending.pop(0)
                    in_flight += 1
                # status faults and disruptions on running jobs
                for plan in plans:
                    if plan.submitted_at is None:
                        continue
                    hist = jobs.get(*plan.key)
                    last = hist.last if hist else {}
                    if plan.status_fault and plan.status_fault_result is None:
                        # When the attempt's training job is live (by the children, not the status,
                        # which lags while the operator is away); currentAttempt null hurts most on attempt 2.
                        need = 2 if (plan.status_fault == "current-attempt-null" and "oom-once" in plan.fate.name) else 1
                        live = children.live_attempts(plan.key)
                        if last.get("phase") in ch.TERMINAL:
                            plan.status_fault_result = {"applied": False, "why": f"job ended ({last.get('phase')}) first"}
                        elif live and max(live) >= need and last.get("currentAttempt"):
                            fn = {"current-attempt-null": ch.patch_status_current_attempt_null,
                                  "attempt-extra-key": ch.patch_status_attempt_extra_key,
                                  "unknown-status-key": ch.patch_status_unknown_top_key}[plan.status_fault]
                            result = fn(custom, plan.namespace, plan.name)
                            plan.status_fault_result = {"applied": result.get("applied", True), **result}
                            faults.add(f"status-{plan.status_fault}", job=plan.name)
                            say(f"status patch {plan.status_fault} on {plan.namespace}/{plan.name}: {result}")
                    if plan.fate.disrupt and plan.disrupted is None:
                        if last.get("phase") in ch.TERMINAL:
                            plan.disrupted = {"applied": False, "why": f"job ended ({last.get('phase')}) first"}
                        else:
                            running = ch.running_training_pods(core, plan.namespace, plan.name)
                            if running:
                                pod = ch.meta(running[0])["name"]
                                if plan.fate.disrupt == "evict":
                                    ch.evict_pod(core, plan.namespace, pod)
                                else:
                                    ch.delete_pod(core, plan.namespace, pod)
                                plan.disrupted = {"applied": True, "how": plan.fate.disrupt, "pod": pod}
                                faults.add(f"pod-{plan.fate.disrupt}", job=plan.name, pod=pod)
                                say(f"{plan.fate.disrupt} pod {plan.namespace}/{pod}")
            except Exception as exc:  # the apiserver is away for a moment: try again next round
                loop_errors += 1
                if loop_errors % 20 == 1:
                    say(f"(API error, retrying: {str(exc)[:160]})")
            all_submitted = not pending
            if all_submitted and chaos.finished.is_set():
                orphans = [p.name for p in plans if state_of(p) in ch.TERMINAL and children.live_count(p.key) > 0]
                if all(settled(p) for p in plans) and not orphans and queue.pending() == 0:
                    settled_at = time.monotonic()
                    say("settled")
                    break
            if t - last_report > 30:
                last_report = t
                states: dict[str, int] = {}
                for p in plans:
                    s = state_of(p) if p.submitted_at else "waiting"
                    states[s] = states.get(s, 0) + 1
                say(f"t={t - t_faults:.0f}s kills={faults.count('operator-sigkill')} "
                    f"apiserver={faults.count('apiserver-restart')} states={states} "
                    f"dups={len(children.duplicates())} unsuspended={len(queue.incidents)}")
            time.sleep(0.3)

        stop_faults = time.monotonic()
        stop.set()  # stops chaos (if still going), watches and the queue's admissions
        chaos.join(timeout=120)
        foreign.final_check()
        result = evaluate(cfg, plans, jobs, children, queue, foreign, faults, chaos, operator,
                          t_start=t_start, t_faults=t_faults, settled_at=settled_at, ended_at=stop_faults,
                          lab_seconds=t_faults - t_start)
        result["logs"] = {"operator": str(operator.log_path), "workdir": str(workdir)}
        result["operator_source"] = source
        return result
    finally:
        stop.set()
        if queue is not None:
            queue.stop_webhook()
        if operator is not None:
            operator.stop()
        if cfg.keep_lab:
            say(f"lab left running: export KUBECONFIG={lab.kubeconfig}")
        else:
            lab.down()


# ---------------------------------------------------------------------------
# figures
# ---------------------------------------------------------------------------


def operator_lines(log_text: str, job: str, limit: int = 12) -> list[str]:
    pattern = re.compile(rf"\b{re.escape(job)}\b")
    lines = [line for line in log_text.splitlines() if pattern.search(line)]
    return lines[-limit:]


def evaluate(cfg: Config, plans: list[JobPlan], jobs: ch.JobTracker, children: ch.ChildTracker, queue: ch.QueueSim,
             foreign: ch.ForeignObjects, faults: Faults, chaos: Chaos, operator: h.OperatorProcess, *,
             t_start: float, t_faults: float, settled_at: float | None, ended_at: float, lab_seconds: float) -> dict[str, Any]:
    log_text = operator.logs()
    per_job = []
    right = 0
    stuck = []
    adopted = []
    for plan in plans:
        hist = jobs.get(*plan.key)
        last = hist.last if hist else {}
        phase = last.get("phase") or ("(never seen)" if hist is None else "")
        created = children.names_created(plan.key)
        clash_named = bool(plan.clash_name and hist and any(plan.clash_name in m for m in hist.messages))
        if plan.fate.expect == "Blocked":
            ran_on_foreign = plan.fate.clash[0] == "ConfigMap" and plan.clash_name in created
            if ran_on_foreign:
                adopted.append(plan.clash_name)
            touched = bool(plan.foreign and plan.foreign.events)
            ok = clash_named and not ran_on_foreign and not touched
            state = "Blocked" if clash_named and phase not in ch.TERMINAL else phase
            is_stuck = not clash_named and phase not in ch.TERMINAL
        else:
            ok = phase == plan.fate.expect
            state = phase
            is_stuck = phase not in ch.TERMINAL
        if hist is None or hist.deleted:
            is_stuck = True
        right += ok
        if is_stuck:
            stuck.append(plan.name)
        per_job.append({
            "namespace": plan.namespace, "name": plan.name, "fate": plan.fate.name, "expected": plan.fate.expect,
            "final": state, "right": ok, "stuck": is_stuck, "attempts": [
                {k: a.get(k) for k in ("attempt", "pytorchJob", "outcome", "message")} for a in last.get("attempts") or []],
            "currentAttempt": last.get("currentAttempt"), "conditions": [
                {k: c.get(k) for k in ("type", "status", "reason", "message")} for c in last.get("conditions") or []],
            "pytorchjobs_created": created, "clash": plan.clash_name, "clash_named_in_a_condition": clash_named,
            "status_fault": plan.status_fault, "status_fault_result": plan.status_fault_result,
            "disruption": plan.disrupted, "phases": [p for _, p in hist.phases] if hist else [],
            "operator_log": operator_lines(log_text, plan.name) if not ok or is_stuck else [],
        })
    dup = children.duplicates()
    regress = children.regressions()
    touched = foreign.touched()
    unsusp = queue.incidents
    orphans = [p.name for p in plans
               if ((jobs.get(*p.key).last if jobs.get(*p.key) else {}).get("phase") in ch.TERMINAL)
               and children.live_count(p.key) > 0]
    last_fault = faults.last()
    settle_s = round(settled_at - last_fault, 1) if settled_at is not None and last_fault is not None else None

    def incident_json(i: ch.Incident) -> dict[str, Any]:
        return {**i.to_json(t_faults), "operator_log": operator_lines(log_text, i.job)}

    foreign_json = [{"kind": f.kind, "namespace": f.namespace, "name": f.name, "job": f.job,
                     "events": [{**e, "at": round(e["at"] - t_faults, 2)} for e in f.events],
                     "operator_log": operator_lines(log_text, f.name)} for f in foreign.items.values()]
    status_faults = {k: sum(1 for p in plans if p.status_fault == k and (p.status_fault_result or {}).get("applied"))
                     for k in STATUS_FAULTS}
    figures = {
        "jobs": len(plans),
        "duplicate_training_jobs": len(dup),
        "jobs_with_duplicates": len({(i.namespace, i.job) for i in dup}),
        "attempt_numbers_backwards": len(regress),
        "lost_or_stuck": len(stuck),
        "foreign_objects": len(foreign.items),
        "foreign_touched": len(touched) + len([a for a in adopted if a not in {f.name for f in touched}]),
        "foreign_adopted": len(adopted),
        "unsuspended_by_others": len(unsusp),
        "queued_children_created_unsuspended": len(queue.created_unsuspended),
        "right_terminal_state": right,
        "right_terminal_state_pct": round(100.0 * right / max(len(plans), 1), 1),
        "live_children_of_finished_jobs": len(orphans),
        "settle_seconds_after_last_fault": settle_s,
        "settled": settled_at is not None,
        "operator_kills": faults.count("operator-sigkill"),
        "apiserver_restarts": faults.count("apiserver-restart"),
        "status_patches": status_faults,
        "evictions": faults.count("pod-evict"),
        "pod_deletes": faults.count("pod-delete"),
        "queued_children": len(queue.queued),
        "queue_admissions": queue.admissions,
        "queue_resuspends": queue.resuspends,
        "operator_pauses_by_peering": log_text.count("Pausing operations"),
        "operator_leads_by_lease": log_text.count("leads (lease"),
        "operator_paused_seconds": round(chaos.paused_seconds, 1),
        "operator_tracebacks": log_text.count("Traceback (most recent call last)"),
        "fault_phase_seconds": round(ended_at - t_faults, 1),
        "lab_setup_seconds": round(lab_seconds, 1),
        "wall_seconds": round(time.monotonic() - t_start, 1),
    }
    ok = (figures["duplicate_training_jobs"] == 0 and figures["attempt_numbers_backwards"] == 0
          and figures["lost_or_stuck"] == 0 and figures["foreign_touched"] == 0
          and figures["unsuspended_by_others"] == 0 and right == len(plans) and settled_at is not None)
    return {
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(cfg).items()},
        "figures": figures,
        "pass": ok,
        "duplicates": [incident_json(i) for i in dup],
        "attempt_regressions": [incident_json(i) for i in regress],
        "unsuspended": [incident_json(i) for i in unsusp],
        "created_unsuspended": [incident_json(i) for i in queue.created_unsuspended],
        "foreign": foreign_json,
        "stuck": stuck,
        "live_children_of_finished_jobs": orphans,
        "chaos_errors": chaos.errors,
        "faults": [{**f, "at": round(f["at"] - t_faults, 2)} for f in faults.items],
        "jobs": per_job,
    }


def table(result: dict[str, Any]) -> str:
    f = result["figures"]
    by_fate: dict[str, list[int]] = {}
    for job in result["jobs"]:
        row = by_fate.setdefault(job["fate"], [0, 0])
        row[0] += 1
        row[1] += job["right"]
    rows = [
        ("duplicate training jobs (>1 live PyTorchJob per job)", f"{f['duplicate_training_jobs']} in {f['jobs_with_duplicates']} jobs", "0", f["duplicate_training_jobs"] == 0),
        ("attempt numbers that went backwards", f["attempt_numbers_backwards"], "0", f["attempt_numbers_backwards"] == 0),
        ("jobs lost or stuck at the deadline", f["lost_or_stuck"], "0", f["lost_or_stuck"] == 0),
        ("foreign objects touched (of those pre-created)", f"{f['foreign_touched']} / {f['foreign_objects']} (adopted {f['foreign_adopted']})", "0", f["foreign_touched"] == 0),
        ("queued children un-suspended before admission", f["unsuspended_by_others"], "0", f["unsuspended_by_others"] == 0),
        ("jobs in the expected terminal state", f"{f['right_terminal_state']} / {f['jobs']} ({f['right_terminal_state_pct']}%)", "100%", f["right_terminal_state"] == f["jobs"]),
        ("live children of finished jobs", f["live_children_of_finished_jobs"], "0", f["live_children_of_finished_jobs"] == 0),
        ("time from last fault to settled", f"{f['settle_seconds_after_last_fault']} s" if f["settled"] else "never settled", "-", f["settled"]),
    ]
    out = ["", f"{'figure':<55} {'value':>24}  goal  ok", "-" * 90]
    out += [f"{name:<55} {str(value):>24}  {goal:>4}  {'yes' if good else 'NO'}" for name, value, goal, good in rows]
    out += ["", f"{'faults injected':<55}", "-" * 90]
    sp = f["status_patches"]
    out += [
        f"{'operator SIGKILLs / apiserver restarts':<55} {f['operator_kills']} / {f['apiserver_restarts']}",
        f"{'status patches: currentAttempt null / extra attempts[] key / unknown key':<55} {sp['current-attempt-null']} / {sp['attempt-extra-key']} / {sp['unknown-status-key']}",
        f"{'evictions (API) / pod deletes':<55} {f['evictions']} / {f['pod_deletes']}",
        f"{'queued children / admissions / re-suspended':<55} {f['queued_children']} / {f['queue_admissions']} / {f['queue_resuspends']}",
        f"{'restarted operator waiting to lead (peering pauses / lease)':<55} {f['operator_pauses_by_peering']} / {f['operator_leads_by_lease']} times, {f['operator_paused_seconds']} s waiting",
        "", f"{'fate':<20} {'jobs':>5} {'right':>6}", "-" * 33,
    ]
    out += [f"{fate:<20} {n:>5} {r:>6}" for fate, (n, r) in sorted(by_fate.items())]
    wrong = [j for j in result["jobs"] if not j["right"]]
    if wrong:
        out += ["", "jobs not in the expected state:"]
        out += [f"  {j['namespace']}/{j['name']} ({j['fate']}): expected {j['expected']}, got {j['final'] or '-'}; "
                f"children {j['pytorchjobs_created']}" for j in wrong]
    return "\n".join(out)


def summary(result: dict[str, Any]) -> str:
    f = result["figures"]
    settle = f"{f['settle_seconds_after_last_fault']}s" if f["settled"] else "never"
    return (f"chaos: jobs={f['jobs']} duplicates={f['duplicate_training_jobs']} backwards={f['attempt_numbers_backwards']} "
            f"stuck={f['lost_or_stuck']} foreign_touched={f['foreign_touched']} unsuspended={f['unsuspended_by_others']} "
            f"right={f['right_terminal_state']}/{f['jobs']} ({f['right_terminal_state_pct']}%) settle={settle} "
            f"kills={f['operator_kills']} apiserver_restarts={f['apiserver_restarts']} wall={f['wall_seconds']:.0f}s "
            f"{'PASS' if result['pass'] else 'FAIL'}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python bench/chaos.py", description=__doc__.splitlines()[0])
    d = Config()
    parser.add_argument("--jobs", type=int, default=d.jobs)
    parser.add_argument("--kills", type=int, default=d.kills, help="operator SIGKILLs")
    parser.add_argument("--apiserver-restarts", type=int, default=d.apiserver_restarts)
    parser.add_argument("--seed", type=int, default=d.seed)
    parser.add_argument("--namespaces", type=int, default=d.namespaces)
    parser.add_argument("--concurrency", type=int, default=d.concurrency, help="jobs in flight at once")
    parser.add_argument("--gap-min", type=float, default=d.gap_min, help="seconds between kills, lower bound")
    parser.add_argument("--gap-max", type=float, default=d.gap_max, help="seconds between kills, upper bound")
    parser.add_argument("--deadline", type=float, default=d.deadline, help="hard limit in seconds after the faults start")
    parser.add_argument("--standalone", action="store_true", help="run the operator without leader election (no Lease / kopf peering)")
    parser.add_argument("--prune-unknown-status", action="store_true",
                        help="leave the CRD as installed (the apiserver prunes unknown status keys)")
    parser.add_argument("--json-out", type=Path, default=d.json_out)
    parser.add_argument("--keep-lab", action="store_true")
    parser.add_argument("--operator-rev", help="run the operator, CRD and chart of this git revision (e.g. HEAD) "
                        "instead of the working tree")
    args = parser.parse_args(argv)
    cfg = Config(jobs=args.jobs, kills=args.kills, apiserver_restarts=args.apiserver_restarts, seed=args.seed,
                 namespaces=args.namespaces, concurrency=args.concurrency, gap_min=args.gap_min, gap_max=args.gap_max,
                 deadline=args.deadline, standalone=args.standalone, prune_unknown_status=args.prune_unknown_status,
                 json_out=args.json_out, keep_lab=args.keep_lab, operator_rev=args.operator_rev)
    result = run_benchmark(cfg)
    if cfg.json_out:
        cfg.json_out.parent.mkdir(parents=True, exist_ok=True)
        cfg.json_out.write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(table(result))
    print()
    if cfg.json_out:
        print(f"details: {cfg.json_out}; operator log: {result['logs']['operator']}")
    print(f"operator: {result['operator_source']}")
    print(summary(result), flush=True)
    return 0 if result["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())

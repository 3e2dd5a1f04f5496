"""`make demo`: the operator's main job on the local lab cluster, start to finish.

Brings the lab up (building its binaries on first use), installs the Helm chart and applies a
LoRA job, prints its progress as `kubectl get ftj -w` would and the final `kubectl describe`,
then tears everything down (`--keep` leaves the lab running).

Default (root): real containers on the lab's two real kubelet nodes (e2e/real_node_jobs.py). The
operator and trainer images are built from their Dockerfiles (cached), the chart's operator
Deployment runs as two pods on the nodes (`kubectl -n finetune-system get pods -o wide` is printed),
and the job's pods run as containers of the trainer image in a namespace that enforces the
restricted Pod Security Standard, training a tiny Llama built from a config on this machine's
CPUs. The operator sizes it as the 8B it is planned as, and the lab GPU's rule (true peak 2 x
the estimate) makes the real trainer run out of GPU memory at step 10 of attempt 1; the operator
reads the trainer's failure report from the kubelet's termination message, plans again (another
plan) and attempt 2 resumes from the checkpoint of step 8 and trains to the end. The trainer's
own lines (start, failure, resume, summary, read through `kubectl logs`) and the containers the
nodes' runtimes ran (`crictl ps -a`) are printed at the end.

`--fake-gpu`: the fast story without root (about a minute): the 8B example on the fake GPU nodes,
whose pods the fake GPU ends by rule (no trainer runs); the operator runs here as a process
authenticated as the chart's ServiceAccount.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import sys
import time

from e2e import operator_harness as h
from e2e import real_processes as rp
from e2e.lab.processes import Proc, proc_start_ticks
from e2e.lab.waiting import wait_crd_established


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m e2e.demo", description=__doc__.splitlines()[0])
    parser.add_argument("--keep", action="store_true", help="leave the lab and the operator running at the end")
    parser.add_argument("--true-peak-factor", default=None,
                        help="the (lab) GPU's true peak over our estimate (default 1.7 with --fake-gpu, else 2.0)")
    parser.add_argument("--fake-gpu", action="store_true",
                        help="the fast demo without root: pods on fake GPU nodes ended by rule, no real trainer")
    args = parser.parse_args(argv)
    if args.true_peak_factor is None:
        # The 8B example (LoRA dropout 0.05) dies at 1.7 x; the tiny job planned as an 8B (dropout 0) at 2 x.
        args.true_peak_factor = "1.7" if args.fake_gpu else rp.OOM_FACTOR
    return fake_gpu_demo(args) if args.fake_gpu else real_node_demo(args)


def fake_gpu_demo(args) -> int:
    """The fast story: the 8B example on fake GPU nodes, the operator as a local process."""
    from e2e.lab.build import build
    from e2e.lab.cluster import up

    say("building (or reusing) the lab's binaries (not the S3 server, JobSet, Trainer v2 or Kueue: the demo starts none)")
    build(say=say, optional=False)
    say("starting the lab: etcd, kube-apiserver, scheduler, controller-manager, kwok, training operator")
    lab = up(die_with_parent=not args.keep)
    operator = None
    try:
        lab.kubectl("apply", "--server-side", "-f", str(h.REPO_ROOT / "crds" / "finetunejob.yaml"))
        wait_crd_established(lab, "finetunejobs.finetune.dev")
        say("installing the Helm chart (CRDs, RBAC, policy ConfigMap)")
        h.install_chart(lab)
        # Inside the lab's directory: the operator's kubeconfig holds a ServiceAccount token, and
        # `down` removes the directory (and stops the operator, recorded with the lab's processes).
        workdir = lab.workdir / "demo"
        workdir.mkdir()
        operator = h.OperatorProcess(lab, workdir)
        say(f"starting the operator as ServiceAccount {h.RELEASE_NAMESPACE}/{h.service_account()} (log: {operator.log_path})")
        operator.start()
        lab.procs.append(Proc("operator", operator.proc.pid, proc_start_ticks(operator.proc.pid), str(operator.log_path)))
        lab.save()

        namespace = "team-a"
        lab.kubectl("create", "namespace", namespace, check=False)
        job = h.job_from_example("llama-8b-lora.yaml", "support-bot", namespace,
                                 rule={"true-peak-factor": args.true_peak_factor, "run-duration": "3s"})
        job["spec"]["recovery"] = {"maxAttempts": 4, "backoff": {"initialSeconds": 2, "maxSeconds": 10}}
        say("applying examples/llama-8b-lora.yaml as team-a/support-bot "
            f"(the fake GPU's true peak is {args.true_peak_factor} x our estimate)")
        h.apply_job(lab, job)
        watch(lab, namespace, "support-bot", timeout=300)
        print()
        return 0 if report_end(lab, namespace, "support-bot", args.keep, "and the operator") else 1
    finally:
        if not args.keep:
            if operator is not None:
                operator.stop()
            lab.down()
            say("lab stopped; nothing left running")


REAL_OOM_STEP = 10


def real_node_demo(args) -> int:
    """The default story, on the real kubelet node: the operator and the training pods as real containers."""
    from e2e import real_node_jobs as rn
    from e2e.lab.build import build

    if os.geteuid() != 0:
        say("the real node needs root (it runs containerd, a kubelet and a CNI bridge on this machine): "
            "run `sudo make demo`, or `python -m e2e.demo --fake-gpu` for the fast story on fake GPU nodes")
        return 2
    say("building (or reusing) the lab's binaries, the real node's (kubelet, containerd config, CoreDNS, "
        "the device plugin) and the operator and trainer images from their Dockerfiles")
    build(say=say, optional=False)
    say("starting the lab: etcd, kube-apiserver, scheduler, controller-manager, kwok, training operator, "
        "and two real kubelet nodes with a lab GPU each")
    lab = rn.start_lab(die_with_parent=not args.keep, say=say)
    try:
        say("helm install: the operator Deployment (two replicas, leader election) as pods of the operator image")
        seconds = rn.install_operator(lab)
        say(f"operator pods Ready after {seconds:.0f} s")
        print(lab.kubectl("-n", "finetune-system", "get", "pods", "-o", "wide").stdout)
        namespace, name = "team-a", "support-bot"
        say(f"namespace {namespace} enforces the restricted Pod Security Standard; a tiny Llama (built from a "
            "config) and a chat dataset in its claims (local volumes of the nodes)")
        vocab = rn.restricted_namespace(lab, namespace)
        job = rn.job(name, namespace, vocab, max_steps=24, every_steps=4, global_batch=8,
                     sized_as="llama-3.1-8b", sequence_length=4096,
                     rule={"true-peak-factor": args.true_peak_factor, "oom-step": str(REAL_OOM_STEP)})
        say(f"applying {namespace}/{name}: LoRA, planned as llama-3.1-8b on the real nodes' pool, trained for real "
            f"in the trainer's container (the lab GPU's true peak is {args.true_peak_factor} x our estimate: an OOM "
            f"at step {REAL_OOM_STEP} where the plan does not fit)")
        lab.kubectl("apply", "-f", "-", input=json.dumps(job))
        logs = PodLogs(lab, namespace, name)
        watch(lab, namespace, name, timeout=600, each=logs.keep)
        logs.keep()
        print()
        logs.show()
        print(lab.kubectl("get", "pods", "-n", namespace, "-o", "wide").stdout)
        say("the containers the nodes' runtimes ran for the job (crictl ps -a)")
        for c in rn.crictl_containers(lab):
            if c["labels"].get("io.kubernetes.pod.namespace") == namespace:
                print(f"  {c['labels'].get('io.kubernetes.pod.name'):<32} {c['metadata']['name']:<12} {c['state']}")
        print()
        ok = report_end(lab, namespace, name, args.keep, "and put the host back")
        if not args.keep:
            rp.remove_claims(namespace)
        return 0 if ok else 1
    finally:
        if not args.keep:
            lab.down()
            say("lab stopped, the host put back as it was; nothing left running")


class PodLogs:
    """The trainer's lines of each attempt's master pod, read through `kubectl logs` once its trainer
    container has ended: the operator deletes an attempt's pods before the next attempt starts."""

    def __init__(self, lab, namespace: str, job: str) -> None:
        self.lab, self.namespace, self.job = lab, namespace, job
        self.events: dict[int, list[dict]] = {}

    def keep(self) -> None:
        from e2e.real_node_jobs import trainer_events

        pods = json.loads(self.lab.kubectl("get", "pods", "-n", self.namespace, "-o", "json", check=False).stdout
                          or '{"items": []}')["items"]
        for pod in pods:
            found = re.fullmatch(rf"{re.escape(self.job)}-a(\d+)-master-0", pod["metadata"]["name"])
            if not found or int(found.group(1)) in self.events:
                continue
            ended = [s for s in (pod.get("status") or {}).get("containerStatuses") or []
                     if s["name"] == "pytorch" and "terminated" in (s.get("state") or {})]
            if ended:
                self.events[int(found.group(1))] = trainer_events(self.lab, self.namespace, pod["metadata"]["name"])

    def show(self) -> None:
        say("what the trainer itself said (kubectl logs of each attempt's master pod)")
        for attempt in sorted(self.events):
            print_trainer_lines(attempt, self.events[attempt])
        print()
# The trainer's lines worth showing, and the fields of each.
TRAINER_LINES = {
    "start": ("attempt", "strategy", "worldSize", "microBatchSize", "gradientAccumulation", "startStep", "maxSteps",
              "resumeFrom"),
    "failure": ("reason", "phase", "step", "exitCode", "message"),
    "resume": ("step", "optimizerRestored"),
    "summary": ("status", "startStep", "step", "finalLoss", "tokensPerSecond"),
}


def print_trainer_lines(attempt: int, events: list[dict]) -> None:
    for event in events:
        fields = TRAINER_LINES.get(event.get("event"))
        if fields:
            shown = ", ".join(f"{k}={event[k]}" for k in fields if event.get(k) is not None)
            print(f"  attempt {attempt} {event['event']}: {shown}"[:300])
    losses = rp.losses([e for e in events if e.get("event") == "progress"])
    if losses:
        print(f"  attempt {attempt} loss: " + ", ".join(f"{s}:{v:.3f}" for s, v in sorted(losses.items())[:12]))


def report_end(lab, namespace: str, name: str, keep: bool, stopping: str) -> bool:
    """`kubectl describe` of the job and whether it succeeded; with `keep`, how to reach and stop the
    lab (`stopping`: what stopping it also does)."""
    print(lab.kubectl("describe", "ftj", name, "-n", namespace).stdout)
    final = h.get_job(lab, namespace, name)["status"]
    ok = final.get("phase") == "Succeeded"
    say("the job succeeded" if ok else f"the job ended in phase {final.get('phase')}")
    if keep:
        say(f"the lab is still running: export KUBECONFIG={lab.kubeconfig}")
        say(f"stop it ({stopping}) with: {down_command(lab.workdir)}")
    return ok


def down_command(workdir) -> str:
    """How to stop a lab kept with --keep (its operator is one of its recorded processes)."""
    return f"python -m e2e.lab down --workdir {shlex.quote(str(workdir))}"


def watch(lab, namespace: str, name: str, timeout: float, each=None) -> None:
    """Print a line each time the job's printed columns change, like `kubectl get ftj -w`; `each`
    (if given) is called on every poll."""
    deadline = time.monotonic() + timeout
    last = None
    header_done = False

    def show() -> None:
        nonlocal last, header_done
        out = lab.kubectl("get", "ftj", name, "-n", namespace, check=False).stdout.strip().splitlines()
        if len(out) == 2:
            if not header_done:
                print(out[0])
                header_done = True
            row = " ".join(out[1].split()[:-1])  # drop AGE, which changes every second
            if row != last:
                print(out[1], flush=True)
                last = row

    while time.monotonic() < deadline:
        show()
        if each is not None:
            each()
        status = json.loads(lab.kubectl("get", "ftj", name, "-n", namespace, "-o", "json").stdout).get("status") or {}
        if status.get("phase") in ("Succeeded", "Failed"):
            show()  # the row printed above may be from before the job ended: print the final one
            return
        time.sleep(0.5)
    raise TimeoutError(f"{namespace}/{name} did not finish in {timeout:.0f} s")


def say(message: str) -> None:
    print(f"==> {message}", flush=True)


if __name__ == "__main__":
    sys.exit(main())

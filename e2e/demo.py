"""`make demo`: the operator's main job on the local lab cluster, start to finish.

Brings the lab up (building its binaries on first use), installs the Helm chart (CRDs,
RBAC, policy; the operator itself runs here as a process authenticated as the chart's
ServiceAccount), applies the 8B LoRA example with a fake GPU whose true peak is 1.7 x the
estimate, so that the first attempt dies of a GPU OOM and the operator recovers by
itself, prints the job's progress as `kubectl get ftj -w` would and the final
`kubectl describe`, then tears everything down (`--keep` leaves the lab running).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time

from e2e import operator_harness as h
from e2e.lab.processes import Proc, proc_start_ticks


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m e2e.demo", description=__doc__.splitlines()[0])
    parser.add_argument("--keep", action="store_true", help="leave the lab and the operator running at the end")
    parser.add_argument("--true-peak-factor", default="1.7", help="the fake GPU's true peak over our estimate")
    args = parser.parse_args(argv)

    from e2e.lab.build import build
    from e2e.lab.cluster import up

    say("building (or reusing) the lab's binaries")
    build(say=say)
    say("starting the lab: etcd, kube-apiserver, scheduler, controller-manager, kwok, training operator")
    lab = up(die_with_parent=not args.keep)
    operator = None
    try:
        lab.kubectl("apply", "--server-side", "-f", str(h.REPO_ROOT / "crds" / "finetunejob.yaml"))
        lab.kubectl("wait", "--for=condition=Established", "crd/finetunejobs.finetune.dev", "--timeout=60s")
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
        print(lab.kubectl("describe", "ftj", "support-bot", "-n", namespace).stdout)
        final = h.get_job(lab, namespace, "support-bot")["status"]
        ok = final.get("phase") == "Succeeded"
        say("the job succeeded" if ok else f"the job ended in phase {final.get('phase')}")
        if args.keep:
            say(f"the lab is still running: export KUBECONFIG={lab.kubeconfig}")
            say(f"stop it (and the operator) with: {down_command(lab.workdir)}")
        return 0 if ok else 1
    finally:
        if not args.keep:
            if operator is not None:
                operator.stop()
            lab.down()
            say("lab stopped; nothing left running")


def down_command(workdir) -> str:
    """How to stop a lab kept with --keep (its operator is one of its recorded processes)."""
    return f"python -m e2e.lab down --workdir {shlex.quote(str(workdir))}"


def watch(lab, namespace: str, name: str, timeout: float) -> None:
    """Print a line each time the job's printed columns change, like `kubectl get ftj -w`."""
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

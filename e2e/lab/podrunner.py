"""The lab's process runner: the kubelet for the nodes of pools marked `runner: process`.

kwok plays every other node's kubelet and the fake GPU decides how their pods end. For a pod the
scheduler binds to a process-runner node (label lab.finetune.dev/runner=process) this runs the
pod's own containers, exactly as the API has them, as local processes on this machine:

* command and args (with $(VAR) references expanded as the kubelet does), the environment from
  env (value, fieldRef, resourceFieldRef, configMapKeyRef, secretKeyRef) and envFrom, workingDir;
  init containers first, one after the other, each to exit 0; then the containers together.
  The image is not pulled: `python` is the Python running the lab, with the trainer package
  (images/trainer) on PYTHONPATH, as the trainer image has it installed.
* volumes as directories: a ConfigMap's or Secret's keys as files, a PersistentVolumeClaim as the
  directory of its bound PersistentVolume (hostPath/local path; it outlives the pod), an
  emptyDir per pod, projected service-account volumes (a real bound token); each mounted at its
  path in a mount namespace of the container's own (podsandbox.py).
* rendezvous: an environment variable MASTER_ADDR / PET_MASTER_ADDR that names a Service of the
  pod's namespace resolves to 127.0.0.1 through the container's own /etc/hosts, and MASTER_PORT /
  PET_MASTER_PORT are rewritten to a port this runner gives that Service (one per Service
  object, so two jobs never share a rendezvous port on this one machine).
* memory: each container runs in a cgroup v1 memory cgroup whose limit is the container's
  memory limit (times the lab rule host-memory-scale, default 1): exceeding it is a real kernel
  OOM kill, and the cgroup's oom_kill count is what the status reports as reason OOMKilled.
* status as a kubelet reports it: Running with startedAt when the containers start; each
  container terminated with its exit code (128+signal for a signal), reason Completed / Error /
  OOMKilled, the termination message from the file at terminationMessagePath (a host file
  mounted there; with FallbackToLogsOnError the log tail when the file is empty and the exit
  code is not 0); pod phase Succeeded or Failed (restartPolicy Never).
* logs in the CRI format a kubelet writes, served by kwok (a kwok `Logs` object per pod names
  the files) so `kubectl logs` and pods/log work through the API server.
* deletion: a pod marked for deletion gets SIGTERM, then SIGKILL for every process of its
  cgroups after its grace period; then the runner deletes the pod object (grace 0) as the
  kubelet does.
* the lab GPU: the fake GPU's rule (fate.lab_gpu_environment) becomes environment variables the
  trainer reads (finetune_trainer/faults.py), so the real trainer raises the OOM itself.

Run: python -m e2e.lab.podrunner --kubeconfig PATH --workdir DIR
"""

from __future__ import annotations

import argparse
import base64
import json
import logging
import math
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from kubernetes import client, config, watch
from kubernetes.client.rest import ApiException

from . import fate
from .nodes import GPU_RESOURCE, RUNNER_LABEL, RUNNER_PROCESS

log = logging.getLogger("pod-runner")

REPO_ROOT = Path(__file__).resolve().parents[2]
TRAINER_PATH = REPO_ROOT / "images" / "trainer"
IMAGE_BIN = Path(__file__).resolve().parent / "imagebin"
# The trainer image's python: this interpreter's installation (a virtual environment and the
# interpreter it was made from). `python` in a container's command runs it.
PYTHON_PREFIXES = tuple(sorted({Path(sys.prefix).resolve(), Path(sys.base_prefix).resolve()}))
CGROUP_PARENT_NAME = "finetune-lab-pods"
KWOK_GROUP, KWOK_VERSION, KWOK_LOGS = "kwok.x-k8s.io", "v1alpha1", "logs"
DEFAULT_TERMINATION_PATH = "/dev/termination-log"
# The kubelet's limits: 4096 bytes of message per container; FallbackToLogsOnError takes the last
# 80 lines of the log, at most 2048 bytes of them.
MESSAGE_MAX = 4096
FALLBACK_LINES = 80
FALLBACK_BYTES = 2048
RENDEZVOUS_ADDR = ("MASTER_ADDR", "PET_MASTER_ADDR")
RENDEZVOUS_PORT = ("MASTER_PORT", "PET_MASTER_PORT")
_VAR_REF = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)|\$\$")


def image_paths(volume_targets: list[Path], prefixes: tuple[Path, ...] = PYTHON_PREFIXES) -> list[Path]:
    """What the image brings, mounted over the pod's volumes so that it stays visible when a volume
    covers a folder above it: the trainer package and imagebin/ always (the scratch emptyDir at /tmp
    hides a checkout under /tmp, a CI clone, and the trainer cannot be imported), python's
    installation where a volume covers it (a virtual environment under /tmp: `python` is not found,
    exit 127)."""
    python = [prefix for prefix in prefixes if any(prefix.is_relative_to(target) for target in volume_targets)]
    return [TRAINER_PATH, IMAGE_BIN, *python]


class PodConfigError(Exception):
    """The pod cannot be started as specified (a kubelet's CreateContainerConfigError)."""


def now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def expand(value: str, env: dict[str, str]) -> str:
    """The kubelet's $(VAR) expansion: known variables are replaced, $$ is a literal $, others stay."""

    def sub(m: re.Match) -> str:
        if m.group(0) == "$$":
            return "$"
        name = m.group(1)
        return env[name] if name in env else m.group(0)

    return _VAR_REF.sub(sub, value)


def quantity_bytes(value: str) -> int:
    from finetune_operator.planning.quantities import quantity_bytes as parse

    return int(parse(value, "resources.limits.memory"))


def memory_cgroup_root() -> Path:
    """Where the runner makes its cgroups: under its own memory cgroup (v1), so the lab stays
    inside whatever cgroup the machine gave it."""
    from finetune_trainer.launch import memory_cgroup_dir

    own = memory_cgroup_dir()
    if own is None or not (own / "memory.oom_control").is_file():
        raise RuntimeError("no cgroup v1 memory controller found (/sys/fs/cgroup/memory); the process runner needs it")
    return own / CGROUP_PARENT_NAME


def cgroup_pids(cgroup: Path) -> list[int]:
    try:
        return [int(x) for x in (cgroup / "cgroup.procs").read_text().split()]
    except OSError:
        return []


def kill_cgroup(cgroup: Path, timeout: float = 10.0) -> None:
    """SIGKILL every process of the cgroup until it is empty (cgroup v1 has no cgroup.kill)."""
    deadline = time.monotonic() + timeout
    while True:
        pids = cgroup_pids(cgroup)
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if time.monotonic() > deadline:
            log.warning("cgroup %s still has processes %s", cgroup, pids)
            return
        time.sleep(0.05)


def oom_kills(cgroup: Path) -> int:
    try:
        for line in (cgroup / "memory.oom_control").read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
    except (OSError, ValueError):
        pass
    return 0


def remove_cgroup(cgroup: Path) -> None:
    kill_cgroup(cgroup)
    for _ in range(50):
        try:
            cgroup.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.1)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# ---- one container ------------------------------------------------------------------------------
@dataclass
class ContainerRun:
    name: str
    spec: dict[str, Any]
    log_file: Path
    message_file: Path
    cgroup: Path
    init: bool = False
    proc: subprocess.Popen | None = None
    started_at: str | None = None
    finished_at: str | None = None
    exit_code: int | None = None
    reason: str | None = None
    message: str = ""
    tail: list[str] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _readers: list[threading.Thread] = field(default_factory=list)

    def start(self, sandbox_spec: Path, limit_bytes: int | None) -> None:
        self.cgroup.mkdir(parents=True, exist_ok=True)
        if limit_bytes is not None:
            (self.cgroup / "memory.limit_in_bytes").write_text(str(limit_bytes))
        self.message_file.write_text("")
        self.log_file.touch()
        env = {"PYTHONPATH": str(REPO_ROOT), "PATH": os.environ.get("PATH", "/usr/bin:/bin")}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "e2e.lab.podsandbox", str(sandbox_spec)],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
            cwd=str(REPO_ROOT), start_new_session=True,
        )
        self.started_at = now()
        for stream, pipe in (("stdout", self.proc.stdout), ("stderr", self.proc.stderr)):
            t = threading.Thread(target=self._copy, args=(stream, pipe), daemon=True)
            t.start()
            self._readers.append(t)

    def _copy(self, stream: str, pipe) -> None:
        # The CRI log format (what kubelets write and kwok reads): "<RFC3339Nano> <stream> <F|P> <line>".
        with open(self.log_file, "ab") as out:
            for raw in iter(pipe.readline, b""):
                full = raw.endswith(b"\n")
                line = raw[:-1] if full else raw
                stamp = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
                with self._lock:
                    out.write(f"{stamp} {stream} {'F' if full else 'P'} ".encode() + line + b"\n")
                    out.flush()
                    self.tail.append(line.decode(errors="replace"))
                    del self.tail[:-FALLBACK_LINES]

    def wait(self) -> None:
        assert self.proc is not None
        code = self.proc.wait()
        # The container ends with its first process: whatever it started goes with it.
        kill_cgroup(self.cgroup)
        for t in self._readers:
            t.join(timeout=10)
        self.exit_code = 128 - code if code < 0 else code
        self.finished_at = now()
        oom = oom_kills(self.cgroup)
        if oom > 0:
            self.reason = "OOMKilled"
        else:
            self.reason = "Completed" if self.exit_code == 0 else "Error"
        self.message = self._termination_message()
        remove_cgroup(self.cgroup)

    def _termination_message(self) -> str:
        try:
            text = self.message_file.read_bytes()[:MESSAGE_MAX].decode(errors="replace")
        except OSError:
            text = ""
        if not text.strip() and self.exit_code != 0 and self.spec.get("terminationMessagePolicy") == "FallbackToLogsOnError":
            with self._lock:
                tail = "\n".join(self.tail)
            text = tail.encode()[-FALLBACK_BYTES:].decode(errors="replace")
        return text

    def signal(self, signum: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.kill(self.proc.pid, signum)
            except ProcessLookupError:
                pass

    def status(self) -> dict[str, Any]:
        base = {"name": self.name, "image": self.spec.get("image", ""), "imageID": "", "restartCount": 0,
                "containerID": f"lab://{self.cgroup.parent.name}/{self.name}"}
        if self.exit_code is not None:
            terminated = {"exitCode": self.exit_code, "reason": self.reason, "startedAt": self.started_at,
                          "finishedAt": self.finished_at}
            if self.message:
                terminated["message"] = self.message
            return {**base, "ready": False, "started": False, "state": {"terminated": terminated}}
        if self.started_at is not None:
            return {**base, "ready": not self.init, "started": True, "state": {"running": {"startedAt": self.started_at}}}
        return {**base, "ready": False, "started": False,
                "state": {"waiting": {"reason": "PodInitializing" if not self.init else "Waiting"}}}


# ---- one pod --------------------------------------------------------------------------------------
class PodRun:
    def __init__(self, runner: "PodRunner", pod) -> None:
        self.runner = runner
        self.pod = pod
        self.raw: dict[str, Any] = runner.api.sanitize_for_serialization(pod)
        meta = self.raw["metadata"]
        self.namespace, self.name, self.uid = meta["namespace"], meta["name"], meta["uid"]
        self.key = f"{self.namespace}/{self.name}"
        self.dir = runner.workdir / "pods" / f"{self.namespace}_{self.name}_{self.uid}"
        self.cgroup = runner.cgroup_root / self.uid
        self.init_runs: list[ContainerRun] = []
        self.runs: list[ContainerRun] = []
        self.deleting = threading.Event()
        self.done = threading.Event()
        self.started = now()
        self.phase = "Pending"
        self.pod_message = ""

    # -- preparing --------------------------------------------------------------------------
    def _container_run(self, c: dict, init: bool) -> ContainerRun:
        return ContainerRun(name=c["name"], spec=c, init=init, log_file=self.dir / "logs" / f"{c['name']}.log",
                            message_file=self.dir / "termination" / c["name"], cgroup=self.cgroup / c["name"])

    def volume_dirs(self) -> dict[str, Path]:
        out = {}
        for vol in self.raw["spec"].get("volumes") or []:
            out[vol["name"]] = self._volume(vol)
        return out

    def _volume(self, vol: dict) -> Path:
        core, ns = self.runner.core, self.namespace
        name = vol["name"]
        here = self.dir / "volumes" / name
        if "emptyDir" in vol:
            # medium: Memory is a plain directory here (see e2e/README.md); its data is not charged to the cgroup.
            here.mkdir(parents=True, exist_ok=True)
            return here
        if "configMap" in vol or "secret" in vol:
            src = vol.get("configMap") or vol.get("secret")
            here.mkdir(parents=True, exist_ok=True)
            self._write_keys(here, self._keys(src, "configMap" in vol), src.get("items"), src.get("defaultMode"),
                             optional=bool(src.get("optional")))
            return here
        if "persistentVolumeClaim" in vol:
            claim = vol["persistentVolumeClaim"]["claimName"]
            pvc = core.read_namespaced_persistent_volume_claim(claim, ns)
            if not pvc.spec.volume_name:
                raise PodConfigError(f"volume {name}: claim {claim} is not bound")
            pv = core.read_persistent_volume(pvc.spec.volume_name)
            path = (pv.spec.host_path.path if pv.spec.host_path else
                    pv.spec.local.path if pv.spec.local else None)
            if path is None:
                # Another volume type: a directory of the lab per PersistentVolume, kept across pods.
                path = str(self.runner.workdir / "volumes" / pv.metadata.name)
            Path(path).mkdir(parents=True, exist_ok=True)
            return Path(path)
        if "hostPath" in vol:
            path = Path(vol["hostPath"]["path"])
            if vol["hostPath"].get("type") in ("DirectoryOrCreate", None, ""):
                path.mkdir(parents=True, exist_ok=True)
            return path
        if "projected" in vol:
            here.mkdir(parents=True, exist_ok=True)
            for source in vol["projected"].get("sources") or []:
                self._project(here, source)
            return here
        if "downwardAPI" in vol:
            here.mkdir(parents=True, exist_ok=True)
            self._project(here, {"downwardAPI": vol["downwardAPI"]})
            return here
        kinds = sorted(k for k in vol if k != "name")
        raise PodConfigError(f"volume {name}: {', '.join(kinds)} is not supported by the lab's process runner")

    def _keys(self, src: dict, is_config_map: bool) -> dict[str, bytes] | None:
        core, ns = self.runner.core, self.namespace
        ref = src.get("name") if is_config_map else src.get("secretName")
        try:
            if is_config_map:
                cm = core.read_namespaced_config_map(ref, ns)
                data = {k: v.encode() for k, v in (cm.data or {}).items()}
                data |= {k: base64.b64decode(v) for k, v in (cm.binary_data or {}).items()}
                return data
            secret = core.read_namespaced_secret(ref, ns)
            return {k: base64.b64decode(v) for k, v in (secret.data or {}).items()}
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def _write_keys(self, here: Path, data: dict[str, bytes] | None, items: list | None, mode: int | None,
                    optional: bool) -> None:
        if data is None:
            if optional:
                return
            raise PodConfigError(f"{here.name}: the ConfigMap/Secret it names does not exist")
        chosen = [(i["key"], i["path"], i.get("mode")) for i in items] if items else [(k, k, None) for k in data]
        for key, rel, item_mode in chosen:
            if key not in data:
                if optional:
                    continue
                raise PodConfigError(f"volume {here.name}: key {key} not found")
            target = here / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data[key])
            target.chmod(item_mode or mode or 0o644)

    def _project(self, here: Path, source: dict) -> None:
        if "serviceAccountToken" in source:
            tok = source["serviceAccountToken"]
            sa = self.raw["spec"].get("serviceAccountName") or "default"
            body = {"spec": {"audiences": [tok["audience"]] if tok.get("audience") else None,
                             "expirationSeconds": tok.get("expirationSeconds") or 3607,
                             "boundObjectRef": {"kind": "Pod", "apiVersion": "v1", "name": self.name, "uid": self.uid}}}
            made = self.runner.core.create_namespaced_service_account_token(sa, self.namespace, body)
            (here / tok["path"]).write_text(made.status.token)
        elif "configMap" in source or "secret" in source:
            src = source.get("configMap") or source.get("secret")
            is_cm = "configMap" in source
            keys = self._keys({"name": src.get("name")} if is_cm else {"secretName": src.get("name")}, is_cm)
            self._write_keys(here, keys, src.get("items"), None, bool(src.get("optional")))
        elif "downwardAPI" in source:
            for item in source["downwardAPI"].get("items") or []:
                if "fieldRef" not in item:
                    raise PodConfigError(f"downwardAPI item {item.get('path')}: only fieldRef is supported")
                (here / item["path"]).parent.mkdir(parents=True, exist_ok=True)
                (here / item["path"]).write_text(self.field(item["fieldRef"]["fieldPath"]))
        else:
            raise PodConfigError(f"projected source {sorted(source)} is not supported by the lab's process runner")

    def field(self, path: str) -> str:
        meta, spec = self.raw["metadata"], self.raw["spec"]
        simple = {"metadata.name": meta["name"], "metadata.namespace": meta["namespace"], "metadata.uid": meta["uid"],
                  "spec.nodeName": spec.get("nodeName", ""), "spec.serviceAccountName": spec.get("serviceAccountName", ""),
                  "status.hostIP": "127.0.0.1", "status.podIP": "127.0.0.1"}
        if path in simple:
            return simple[path]
        m = re.fullmatch(r"metadata\.(labels|annotations)\['([^']+)'\]", path)
        if m:
            return (meta.get(m.group(1)) or {}).get(m.group(2), "")
        if path in ("metadata.labels", "metadata.annotations"):
            values = meta.get(path.split(".")[1]) or {}
            return "\n".join(f'{k}="{v}"' for k, v in sorted(values.items()))
        raise PodConfigError(f"fieldRef {path} is not supported by the lab's process runner")

    def _env_value(self, c: dict, item: dict) -> str | None:
        src = item["valueFrom"]
        if "fieldRef" in src:
            return self.field(src["fieldRef"]["fieldPath"])
        if "resourceFieldRef" in src:
            ref = src["resourceFieldRef"]
            kind, _, res = ref["resource"].partition(".")
            value = ((c.get("resources") or {}).get(kind) or {}).get(res)
            if value is None:
                raise PodConfigError(f"env {item['name']}: {ref['resource']} is not set")
            divisor = ref.get("divisor") or "1"
            if res == "memory":
                return str(math.ceil(quantity_bytes(value) / quantity_bytes(divisor)))
            return str(math.ceil(float(value.rstrip("m")) / (1000 if value.endswith("m") else 1) / float(divisor.rstrip("m") or 1)))
        for kind in ("configMapKeyRef", "secretKeyRef"):
            if kind in src:
                ref = src[kind]
                data = self._keys({"name": ref["name"]} if kind == "configMapKeyRef" else {"secretName": ref["name"]},
                                  kind == "configMapKeyRef")
                if data is None or ref["key"] not in data:
                    if ref.get("optional"):
                        return None
                    raise PodConfigError(f"env {item['name']}: {kind} {ref['name']}/{ref['key']} not found")
                return data[ref["key"]].decode()
        raise PodConfigError(f"env {item['name']}: valueFrom {sorted(src)} is not supported")

    def environment(self, c: dict) -> dict[str, str]:
        # What the image provides, then what the pod says (the pod's own variables win).
        env: dict[str, str] = {
            # The trainer image's python, then the tools other images bring (imagebin/: nslookup).
            "PATH": f"{Path(sys.executable).parent}:{IMAGE_BIN}:/usr/local/bin:/usr/bin:/bin",
            "PYTHONPATH": str(TRAINER_PATH),
            "HOSTNAME": self.name,
        }
        for src in c.get("envFrom") or []:
            prefix = src.get("prefix", "")
            if "configMapRef" in src or "secretRef" in src:
                is_cm = "configMapRef" in src
                ref = src.get("configMapRef") or src.get("secretRef")
                data = self._keys({"name": ref["name"]} if is_cm else {"secretName": ref["name"]}, is_cm)
                if data is None:
                    if ref.get("optional"):
                        continue
                    raise PodConfigError(f"envFrom {ref['name']} not found")
                env |= {prefix + k: v.decode() for k, v in data.items()}
        for item in c.get("env") or []:
            if "valueFrom" in item:
                value = self._env_value(c, item)
                if value is None:
                    continue
            else:
                value = expand(item.get("value", ""), env)
            env[item["name"]] = value
        return env

    def rendezvous(self, env: dict[str, str]) -> list[str]:
        """Rewrite MASTER_ADDR/PORT that name a Service of the namespace; return the names for /etc/hosts."""
        names: list[str] = []
        for addr_key in RENDEZVOUS_ADDR:
            addr = env.get(addr_key)
            if not addr:
                continue
            service = addr.split(".")[0]
            try:
                svc = self.runner.core.read_namespaced_service(service, self.namespace)
            except ApiException as exc:
                if exc.status == 404:
                    continue
                raise
            port = self.runner.port_for(svc.metadata.uid)
            names += [addr, service, f"{service}.{self.namespace}", f"{service}.{self.namespace}.svc",
                      f"{service}.{self.namespace}.svc.cluster.local"]
            for port_key in RENDEZVOUS_PORT:
                if port_key in env:
                    env[port_key] = str(port)
        return sorted(set(names))

    def service_names(self) -> list[str]:
        if not hasattr(self, "_service_names"):
            names: set[str] = set()
            for c in (self.raw["spec"].get("initContainers") or []) + self.raw["spec"]["containers"]:
                names.update(self.rendezvous(self.environment(c)))
            self._service_names = sorted(names)
        return self._service_names

    def lab_gpu(self) -> dict[str, str]:
        """The lab GPU's variables for the trainer (finetune_trainer.faults), from the fake GPU's rule."""
        gpu = self.runner.fake_gpu
        node = self.raw["spec"]["nodeName"]
        meta = self.pod.metadata
        rule = fate.resolve_rule(gpu.rule_sources(self.pod))
        self.memory_scale = rule.host_memory_scale
        wants_gpu = any(((c.get("resources") or {}).get("limits") or {}).get(GPU_RESOURCE)
                        for c in self.raw["spec"]["containers"])
        if not wants_gpu:
            return {}  # no GPU asked for: the lab GPU plays no part
        pod = fate.TrainingPod(
            name=self.key,
            predicted_peak_bytes=fate.parse_predicted_peak((meta.annotations or {}).get(fate.PREDICTED_PEAK_ANNOTATION)),
            gpu_memory_mib=fate.parse_gpu_memory_mib(gpu.node_labels(node).get(fate.GPU_MEMORY_LABEL), node),
            rank=fate.rank_of(meta.labels), attempt=fate.attempt_of(meta.labels))
        return fate.lab_gpu_environment(pod, rule)

    def sandbox_spec(self, run: ContainerRun, volumes: dict[str, Path], extra_env: dict[str, str]) -> Path:
        c = run.spec
        mounts = []
        for vm in c.get("volumeMounts") or []:
            if vm["name"] not in volumes:
                raise PodConfigError(f"container {c['name']}: volumeMount {vm['name']} names no volume")
            source = volumes[vm["name"]]
            if vm.get("subPath"):
                source = source / vm["subPath"]
                source.mkdir(parents=True, exist_ok=True)
            mounts.append({"source": str(source), "target": vm["mountPath"], "readOnly": bool(vm.get("readOnly"))})
        env = self.environment(c)
        self.rendezvous(env)
        env |= extra_env
        # Every container of the pod sees the same names (the training operator's init container
        # looks the master up without having MASTER_ADDR itself).
        hosts_names = self.service_names()
        hosts = self.dir / "hosts"
        base = Path("/etc/hosts").read_text() if Path("/etc/hosts").exists() else "127.0.0.1 localhost\n"
        lines = [base.rstrip("\n"), f"127.0.0.1 {self.name}"]
        if hosts_names:
            lines.append("# rendezvous Services of this pod, on this machine (lab process runner)")
            lines.append("127.0.0.1 " + " ".join(hosts_names))
        hosts.write_text("\n".join(lines) + "\n")
        mounts.append({"source": str(hosts), "target": "/etc/hosts", "readOnly": True})
        for image_path in image_paths([Path(m["target"]) for m in mounts]):
            mounts.append({"source": str(image_path), "target": str(image_path), "readOnly": True})
        mounts.append({"source": str(run.message_file), "target": c.get("terminationMessagePath") or DEFAULT_TERMINATION_PATH,
                       "readOnly": False})
        argv = [expand(a, env) for a in (c.get("command") or []) + (c.get("args") or [])]
        if not c.get("command"):
            raise PodConfigError(f"container {c['name']}: no command; the lab has no image to take an entrypoint from")
        spec = {"cgroup": str(run.cgroup), "mounts": mounts, "workingDir": c.get("workingDir") or "/",
                "argv": argv, "env": env}
        path = self.dir / "sandbox" / f"{c['name']}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(spec, indent=2))
        return path

    def limit_bytes(self, c: dict) -> int | None:
        limit = ((c.get("resources") or {}).get("limits") or {}).get("memory")
        if limit is None:
            return None
        return max(1, int(quantity_bytes(limit) * getattr(self, "memory_scale", 1.0)))

    # -- running ----------------------------------------------------------------------------
    def run(self) -> None:
        try:
            self._run()
        except Exception as exc:  # a pod the lab cannot run fails loudly, never hangs in Pending
            log.exception("pod %s", self.key)
            if not self.deleting.is_set():
                self.phase, self.pod_message = "Failed", f"lab process runner: {exc}"
                self.report(reason="CreateContainerConfigError" if isinstance(exc, (PodConfigError, fate.RuleError)) else "Error")
        finally:
            for r in self.init_runs + self.runs:
                if r.proc is not None and r.exit_code is None:
                    r.signal(signal.SIGKILL)
            self.done.set()
            if self.deleting.is_set():
                self.runner.finish_deletion(self)

    def _run(self) -> None:
        spec = self.raw["spec"]
        if spec.get("restartPolicy", "Always") != "Never":
            raise PodConfigError(f"restartPolicy {spec.get('restartPolicy', 'Always')}: the lab's process runner "
                                 "runs restartPolicy Never pods only (training pods are)")
        for d in ("logs", "termination", "volumes"):
            (self.dir / d).mkdir(parents=True, exist_ok=True)
        self.init_runs = [self._container_run(c, True) for c in spec.get("initContainers") or []]
        self.runs = [self._container_run(c, False) for c in spec["containers"]]
        self.runner.publish_logs(self)
        lab_env = self.lab_gpu()
        volumes = self.volume_dirs()
        self.phase = "Pending"
        self.report()
        for run in self.init_runs:
            if self.deleting.is_set():
                return
            run.start(self.sandbox_spec(run, volumes, lab_env), self.limit_bytes(run.spec))
            self.report()
            run.wait()
            if run.exit_code != 0:
                self.phase = "Failed"
                self.report()
                return
        if self.deleting.is_set():
            return
        specs = [self.sandbox_spec(run, volumes, lab_env) for run in self.runs]
        for run, path in zip(self.runs, specs):
            run.start(path, self.limit_bytes(run.spec))
        self.phase = "Running"
        self.report()
        log.info("pod %s running: %s", self.key, ", ".join(f"{r.name} pid {r.proc.pid}" for r in self.runs))
        waiters = [threading.Thread(target=r.wait, daemon=True) for r in self.runs]
        for t in waiters:
            t.start()
        for t in waiters:
            t.join()
        self.phase = "Succeeded" if all(r.exit_code == 0 for r in self.runs) else "Failed"
        self.report()
        log.info("pod %s %s: %s", self.key, self.phase,
                 ", ".join(f"{r.name} exit {r.exit_code} {r.reason}" for r in self.runs))

    def terminate(self, grace: float) -> None:
        """The kubelet's kill: SIGTERM to each container's first process, SIGKILL for all after `grace`."""
        self.deleting.set()
        for r in self.init_runs + self.runs:
            r.signal(signal.SIGTERM)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and not self.done.is_set():
            time.sleep(0.1)
        for r in self.init_runs + self.runs:
            kill_cgroup(r.cgroup)

    # -- reporting --------------------------------------------------------------------------
    def report(self, reason: str | None = None) -> None:
        initialized = all(r.exit_code == 0 for r in self.init_runs)
        running = self.phase == "Running"
        stamp = now()
        conditions = [
            {"type": "PodReadyToStartContainers", "status": "True", "lastTransitionTime": self.started},
            {"type": "Initialized", "status": "True" if initialized else "False", "lastTransitionTime": stamp},
            {"type": "ContainersReady", "status": "True" if running else "False", "lastTransitionTime": stamp},
            {"type": "Ready", "status": "True" if running else "False", "lastTransitionTime": stamp},
        ]
        status: dict[str, Any] = {
            "phase": self.phase, "conditions": conditions, "hostIP": "127.0.0.1", "hostIPs": [{"ip": "127.0.0.1"}],
            "podIP": "127.0.0.1", "podIPs": [{"ip": "127.0.0.1"}], "startTime": self.started,
            "containerStatuses": [r.status() for r in self.runs],
        }
        if self.init_runs:
            status["initContainerStatuses"] = [r.status() for r in self.init_runs]
        if reason:
            status["reason"], status["message"] = reason, self.pod_message
        try:
            self.runner.core.patch_namespaced_pod_status(self.name, self.namespace, {"status": status})
        except ApiException as exc:
            if exc.status != 404:
                log.warning("pod %s: status patch failed: %s", self.key, exc.reason)


# ---- the runner ----------------------------------------------------------------------------------
class PodRunner:
    def __init__(self, api: client.ApiClient, workdir: Path) -> None:
        from .fakegpu import FakeGPU

        self.api = api
        self.core = client.CoreV1Api(api)
        self.custom = client.CustomObjectsApi(api)
        self.fake_gpu = FakeGPU(api)  # its rule lookup (pod, FineTuneJob, namespace ConfigMap)
        self.workdir = workdir
        self.cgroup_root = memory_cgroup_root()
        self.cgroup_root.mkdir(exist_ok=True)
        self.pods: dict[str, PodRun] = {}  # by pod uid
        self.ports: dict[str, int] = {}
        self.lock = threading.Lock()
        self._node_is_runner: dict[str, bool] = {}

    def port_for(self, service_uid: str) -> int:
        with self.lock:
            if service_uid not in self.ports:
                self.ports[service_uid] = free_port()
            return self.ports[service_uid]

    def runner_nodes(self) -> set[str]:
        nodes = self.core.list_node(label_selector=f"{RUNNER_LABEL}={RUNNER_PROCESS}").items
        return {n.metadata.name for n in nodes}

    def publish_logs(self, run: PodRun) -> None:
        """A kwok Logs object for the pod (owned by it: the garbage collector removes it with the pod)."""
        body = {
            "apiVersion": f"{KWOK_GROUP}/{KWOK_VERSION}", "kind": "Logs",
            "metadata": {"name": run.name, "namespace": run.namespace,
                         "ownerReferences": [{"apiVersion": "v1", "kind": "Pod", "name": run.name, "uid": run.uid}]},
            "spec": {"logs": [{"containers": [r.name], "logsFile": str(r.log_file), "follow": True}
                              for r in run.init_runs + run.runs]},
        }
        for r in run.init_runs + run.runs:
            r.log_file.parent.mkdir(parents=True, exist_ok=True)
            r.log_file.touch()
        try:
            self.custom.create_namespaced_custom_object(KWOK_GROUP, KWOK_VERSION, run.namespace, KWOK_LOGS, body)
        except ApiException as exc:
            if exc.status != 409:
                raise
            # A pod of the same name before this one (a replaced training pod): point at this one's files.
            self.custom.delete_namespaced_custom_object(KWOK_GROUP, KWOK_VERSION, run.namespace, KWOK_LOGS, run.name)
            self.custom.create_namespaced_custom_object(KWOK_GROUP, KWOK_VERSION, run.namespace, KWOK_LOGS, body)

    def is_runner_node(self, name: str | None) -> bool:
        if not name:
            return False
        if name not in self._node_is_runner:
            try:
                labels = self.core.read_node(name).metadata.labels or {}
            except ApiException as exc:
                if exc.status != 404:
                    raise
                labels = {}
            self._node_is_runner[name] = labels.get(RUNNER_LABEL) == RUNNER_PROCESS
        return self._node_is_runner[name]

    def handle(self, kind: str, pod) -> None:
        meta = pod.metadata
        if not self.is_runner_node(pod.spec.node_name):
            return
        run = self.pods.get(meta.uid)
        if kind == "DELETED":
            if run is not None and not run.deleting.is_set():
                threading.Thread(target=run.terminate, args=(0,), daemon=True).start()
            return
        if meta.deletion_timestamp is not None:
            if run is None:
                self.delete_object(meta.namespace, meta.name, meta.uid)
            elif not run.deleting.is_set():
                grace = meta.deletion_grace_period_seconds or 0
                log.info("pod %s/%s marked for deletion: SIGTERM, SIGKILL after %ss", meta.namespace, meta.name, grace)
                threading.Thread(target=run.terminate, args=(grace,), daemon=True).start()
            return
        if run is None and (pod.status.phase in (None, "Pending")) and not (pod.status.container_statuses or []):
            run = PodRun(self, pod)
            self.pods[meta.uid] = run
            threading.Thread(target=run.run, name=f"pod-{meta.name}", daemon=True).start()

    def finish_deletion(self, run: PodRun) -> None:
        run.report()
        self.delete_object(run.namespace, run.name, run.uid)

    def delete_object(self, namespace: str, name: str, uid: str) -> None:
        try:
            self.core.delete_namespaced_pod(name, namespace, body=client.V1DeleteOptions(
                grace_period_seconds=0, preconditions=client.V1Preconditions(uid=uid)))
        except ApiException as exc:
            if exc.status not in (404, 409):
                raise

    def stop_all(self) -> None:
        for run in list(self.pods.values()):
            for r in run.init_runs + run.runs:
                kill_cgroup(r.cgroup)
                remove_cgroup(r.cgroup)
            remove_cgroup(run.cgroup)

    def run(self) -> None:
        while True:
            try:
                pods = self.core.list_pod_for_all_namespaces()
                for pod in pods.items:
                    self.handle("ADDED", pod)
                w = watch.Watch()
                for event in w.stream(self.core.list_pod_for_all_namespaces,
                                      resource_version=pods.metadata.resource_version, timeout_seconds=120):
                    self.handle(event["type"], event["object"])
            except ApiException as exc:
                if exc.status != 410:
                    log.warning("API error, relisting in 1s: %s", exc.reason)
                    time.sleep(1)
            except Exception as exc:  # keep the runner alive across transient errors, but say so
                log.warning("error, relisting in 1s: %r", exc)
                time.sleep(1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m e2e.lab.podrunner", description=__doc__.splitlines()[0])
    parser.add_argument("--kubeconfig", required=True)
    parser.add_argument("--workdir", required=True, type=Path)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s", stream=sys.stderr)
    api = config.new_client_from_config(config_file=args.kubeconfig)
    runner = PodRunner(api, args.workdir)

    def stop(signum, _frame):
        runner.stop_all()
        os._exit(0)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    log.info("process runner for nodes %s (cgroups under %s)", sorted(runner.runner_nodes()), runner.cgroup_root)
    runner.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())

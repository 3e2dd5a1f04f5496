"""Build (or reuse) the lab's binaries: one directory per version set under the cache.

    ~/.cache/finetune-operator/lab/<key>/bin/{etcd,kube-apiserver,kube-scheduler,
        kube-controller-manager,kubectl,kwok,training-operator,helm}
    ~/.cache/finetune-operator/lab/<key>/share/   upstream files the lab reads at run time
        (kwok's default stages, the PyTorchJob CRD and webhook manifest), taken from the Go
        module cache of the pinned releases, never copied into the repository
    ~/.cache/finetune-operator/lab/<key>/build.json   versions, go version, seconds per step

<key> hashes versions.env, the Go version and tools/go.sum, so a version bump builds into a
new directory and a warm start only checks that build.json exists.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from . import toolsmod
from .versions import TOOLS_DIR, Versions, cache_root, load_versions

BINARIES = (
    "etcd",
    "kube-apiserver",
    "kube-scheduler",
    "kube-controller-manager",
    "kubectl",
    "kwok",
    "training-operator",
    "helm",
)

# Upstream files the lab needs at run time: (module, path in module, name under share/).
KWOK_STAGES = (
    "kustomize/stage/node/fast/node-initialize.yaml",
    "kustomize/stage/node/heartbeat-with-lease/node-heartbeat-with-lease.yaml",
    "kustomize/stage/pod/fast/pod-ready.yaml",
    "kustomize/stage/pod/fast/pod-delete.yaml",
)
# kwok's Logs CRD: a Logs object tells kwok which file holds a fake pod's container log, so
# `kubectl logs` and pods/log work for it (e2e/test_progress.py).
KWOK_LOGS_CRD = "kustomize/crd/bases/kwok.x-k8s.io_logs.yaml"
KWOK_LOGS_CRD_SHARE = "kwok-logs-crd.yaml"
PYTORCHJOB_CRD = "manifests/base/crds/kubeflow.org_pytorchjobs.yaml"
TRAINING_WEBHOOKS = "manifests/base/webhook/manifests.yaml"


class BuildError(RuntimeError):
    pass


@lru_cache(maxsize=1)
def go_version() -> str:
    """The Go that builds (honours GOTOOLCHAIN); part of the cache key."""
    try:
        out = subprocess.run(["go", "env", "GOVERSION"], capture_output=True, text=True, timeout=120, check=True)
        return out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "no-go"


# Bumped whenever the way binaries are built changes (flags, ldflags), so a changed recipe
# builds into a new cache directory instead of reusing binaries made the old way.
RECIPE = 2


def cache_key(versions: Versions) -> str:
    import hashlib

    return hashlib.sha256(f"{versions.cache_key()}|{go_version()}|recipe={RECIPE}".encode()).hexdigest()[:16]


def lab_home(versions: Versions | None = None) -> Path:
    versions = versions or load_versions()
    return cache_root() / cache_key(versions)


@dataclass(frozen=True)
class Installation:
    home: Path

    @property
    def bin(self) -> Path:
        return self.home / "bin"

    @property
    def share(self) -> Path:
        return self.home / "share"

    def binary(self, name: str) -> str:
        return str(self.bin / name)

    def manifest(self) -> dict:
        return json.loads((self.home / "build.json").read_text())


def ensure_kwok_logs_crd(inst: Installation) -> Path:
    """share/kwok-logs-crd.yaml, copied from the Go module cache into an installation built before
    the lab needed it (the binaries do not change, so this needs no rebuild)."""
    target = inst.share / KWOK_LOGS_CRD_SHARE
    if not target.is_file():
        kwok_dir = module_dir("sigs.k8s.io/kwok", load_versions().kwok, dict(os.environ))
        tmp = target.with_suffix(f".tmp{os.getpid()}")
        shutil.copyfile(kwok_dir / KWOK_LOGS_CRD, tmp)
        tmp.replace(target)
    return target


def find_installation(versions: Versions | None = None) -> Installation | None:
    """The built lab for the pinned versions, or None when it has not been built."""
    home = lab_home(versions)
    if not (home / "build.json").is_file():
        return None
    inst = Installation(home)
    if any(not (inst.bin / b).is_file() for b in BINARIES):
        return None
    return inst


def _ldflags_for_kubernetes(v: Versions) -> str:
    # Without these the binaries report v0.0.0-master, which breaks version checks in
    # kubectl, helm (kubeVersion constraints) and the operator's discovery.
    major = v.kubernetes.lstrip("v").split(".")[0]
    parts = ["-s", "-w"]
    for pkg in ("k8s.io/component-base/version", "k8s.io/client-go/pkg/version"):
        parts += [
            f"-X {pkg}.gitVersion={v.kubernetes}",
            f"-X {pkg}.gitMajor={major}",
            f"-X {pkg}.gitMinor={v.kubernetes_minor}",
            f"-X {pkg}.gitTreeState=clean",
        ]
    return " ".join(parts)


def _ldflags_for_helm(v: Versions, env: dict) -> str:
    """What helm's own Makefile sets: its version, and the default Kubernetes version for
    `helm template`/`lint` (the client-go minor it was built with, as major 1). Without them
    a source-built helm says v3.22 and renders for Kubernetes v1.20."""
    import re

    go_mod = (module_dir("helm.sh/helm/v3", v.helm, env) / "go.mod").read_text()
    m = re.search(r"^\s*k8s\.io/client-go v0\.(\d+)\.", go_mod, re.MULTILINE)
    if not m:
        raise BuildError("cannot find k8s.io/client-go in helm's go.mod")
    minor = m.group(1)
    parts = ["-s", "-w", f"-X helm.sh/helm/v3/internal/version.version={v.helm}",
             "-X helm.sh/helm/v3/internal/version.gitTreeState=clean"]
    for pkg in ("helm.sh/helm/v3/pkg/lint/rules", "helm.sh/helm/v3/pkg/chartutil"):
        parts += [f"-X {pkg}.k8sVersionMajor=1", f"-X {pkg}.k8sVersionMinor={minor}"]
    return " ".join(parts)


def check_tools_module(v: Versions) -> None:
    declared = toolsmod.declared_versions((TOOLS_DIR / "go.mod").read_text())
    want = {"k8s.io/kubernetes": v.kubernetes, "go.etcd.io/etcd/server/v3": v.etcd, "staging": v.staging}
    if declared != want:
        raise BuildError(
            f"e2e/lab/tools/go.mod pins {declared} but versions.env says {want}; "
            "run `python -m e2e.lab sync-tools` and commit go.mod and go.sum"
        )


def module_dir(module: str, version: str, env: dict) -> Path:
    """Where the Go module cache holds module@version (downloading it if needed)."""
    with tempfile.TemporaryDirectory() as cwd:
        out = subprocess.run(
            ["go", "mod", "download", "-json", f"{module}@{version}"],
            cwd=cwd, env=env, capture_output=True, text=True, timeout=600,
        )
    if out.returncode != 0:
        raise BuildError(f"go mod download {module}@{version} failed: {out.stdout}{out.stderr}")
    return Path(json.loads(out.stdout)["Dir"])


def _run(cmd: list[str], cwd: Path, env: dict, log) -> None:
    log.write(f"$ {' '.join(cmd)}\n")
    log.flush()
    proc = subprocess.run(cmd, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        raise BuildError(f"{' '.join(cmd[:3])} ... failed (exit {proc.returncode}); see {log.name}")


def _timer(timings: dict[str, float], say):
    """step(name, fn): runs fn, saying so, and records its seconds under name in `timings` (build.json)."""
    def step(name: str, fn) -> None:
        say(f"building {name} ...")
        t0 = time.monotonic()
        fn()
        timings[name] = round(time.monotonic() - t0, 1)
        say(f"built {name} in {timings[name]:.0f}s")
    return step


def _build_into(staging: Path, v: Versions, env: dict, log, say) -> dict[str, float]:
    bindir = staging / "bin"
    share = staging / "share"
    bindir.mkdir(parents=True)
    share.mkdir()
    timings: dict[str, float] = {}
    step = _timer(timings, say)

    k8s_cmds = list(toolsmod.KUBERNETES_COMMANDS)
    step(
        "kubernetes (" + ", ".join(c.rsplit("/", 1)[1] for c in k8s_cmds) + ")",
        lambda: _run(
            ["go", "build", "-trimpath", "-buildvcs=false", f"-ldflags={_ldflags_for_kubernetes(v)}", "-o", str(bindir) + "/", *k8s_cmds],
            TOOLS_DIR, env, log,
        ),
    )
    step(
        "etcd",
        lambda: _run(
            ["go", "build", "-trimpath", "-buildvcs=false", "-ldflags=-s -w", "-o", str(bindir / "etcd"),
             toolsmod.ETCD_COMMAND],
            TOOLS_DIR, env, log,
        ),
    )
    # kwok, the training operator and helm build with the dependency set their own releases
    # pinned (`go install module@version`), so their k8s.io client versions stay their own.
    installs = {
        "kwok": (f"sigs.k8s.io/kwok/cmd/kwok@{v.kwok}", "kwok", "-s -w"),
        "training-operator": (
            f"github.com/kubeflow/training-operator/cmd/training-operator.v1@{v.training_operator}",
            "training-operator.v1",
            "-s -w",
        ),
        "helm": (f"helm.sh/helm/v3/cmd/helm@{v.helm}", "helm", _ldflags_for_helm(v, env)),
    }
    for name, (spec, produced, ldflags) in installs.items():
        def install(spec=spec, produced=produced, name=name, ldflags=ldflags) -> None:
            with tempfile.TemporaryDirectory() as cwd:
                _run(
                    ["go", "install", "-trimpath", f"-ldflags={ldflags}", spec],
                    Path(cwd), {**env, "GOBIN": str(bindir)}, log,
                )
            if produced != name:
                (bindir / produced).rename(bindir / name)

        step(name, install)

    kwok_dir = module_dir("sigs.k8s.io/kwok", v.kwok, env)
    stages = share / "kwok-stages"
    stages.mkdir()
    for rel in KWOK_STAGES:
        shutil.copyfile(kwok_dir / rel, stages / Path(rel).name)
    shutil.copyfile(kwok_dir / KWOK_LOGS_CRD, share / KWOK_LOGS_CRD_SHARE)
    to_dir = module_dir("github.com/kubeflow/training-operator", v.training_operator, env)
    shutil.copyfile(to_dir / PYTORCHJOB_CRD, share / "pytorchjob-crd.yaml")
    shutil.copyfile(to_dir / TRAINING_WEBHOOKS, share / "training-operator-webhooks.yaml")
    return timings


def build(force: bool = False, say=None, optional: bool = True) -> Installation:
    """Build every lab binary for the pinned versions unless a complete build is cached, then (with
    `optional`, what the tests need) the S3-compatible server and JobSet + Trainer v2 + Kueue (each
    in its own cache directory inside the lab's). The demo starts none of the optional ones and
    passes optional=False: on a fresh machine they were 513 of its 1593 s."""
    say = say or (lambda msg: print(f"[lab build] {msg}", file=sys.stderr, flush=True))
    installation = _build_kubernetes_lab(force, say)
    if optional:
        build_s3_server(force=force, say=say)
        build_v2(force=force, say=say)
    return installation


def _build_kubernetes_lab(force: bool, say) -> Installation:
    v = load_versions()
    existing = find_installation(v)
    if existing and not force:
        say(f"reusing {existing.home}")
        ensure_kwok_logs_crd(existing)
        return existing
    check_tools_module(v)
    root = cache_root()
    root.mkdir(parents=True, exist_ok=True)
    home = lab_home(v)
    # One builder at a time per cache (a developer and CI may share the machine).
    with open(root / ".build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        existing = find_installation(v)
        if existing and not force:
            say(f"reusing {existing.home} (built while waiting for the lock)")
            return existing
        env = dict(os.environ)
        staging = Path(tempfile.mkdtemp(prefix=f"{home.name}.partial-", dir=root))
        log_path = root / f"{home.name}.build.log"
        say(f"cold build into {home} (log: {log_path})")
        t0 = time.monotonic()
        try:
            with open(log_path, "w") as log:
                timings = _build_into(staging, v, env, log, say)
            manifest = {
                "versions": {k: getattr(v, k) for k in v.__dataclass_fields__},
                "go": go_version(),
                "seconds": timings,
                "total_seconds": round(time.monotonic() - t0, 1),
                "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            }
            (staging / "build.json").write_text(json.dumps(manifest, indent=2) + "\n")
            publish(staging, home)
        finally:
            if staging.exists():
                shutil.rmtree(staging, ignore_errors=True)
        say(f"lab binaries ready in {manifest['total_seconds']:.0f}s: {home}")
        return Installation(home)


# ---------------------------------------------------------------------------
# The S3-compatible server: rclone `serve s3`, from the small main module in s3server/
# ---------------------------------------------------------------------------

S3_MODULE_DIR = Path(__file__).resolve().parent / "s3server"
S3_BINARY = "rclone-s3"
RCLONE_MODULE = "github.com/rclone/rclone"
S3_RECIPE = 1


def check_s3_module(v: Versions) -> None:
    """s3server/go.mod must require the rclone that versions.env pins."""
    import re

    go_mod = (S3_MODULE_DIR / "go.mod").read_text()
    m = re.search(rf"^require {re.escape(RCLONE_MODULE)} (v\S+)$", go_mod, re.MULTILINE)
    declared = m.group(1) if m else None
    if declared != v.rclone:
        raise BuildError(
            f"e2e/lab/s3server/go.mod requires rclone {declared} but versions.env says RCLONE_VERSION={v.rclone};"
            " edit the require line, run `go mod tidy` in e2e/lab/s3server, commit go.mod and go.sum"
        )


def s3_server_home(v: Versions | None = None) -> Path:
    """<lab home>/s3/<key>: inside the lab's directory, so `prune` keeps it with the lab; keyed by
    the rclone version, the main module's files and the Go version, so a bump rebuilds only it."""
    import hashlib

    v = v or load_versions()
    h = hashlib.sha256(f"rclone={v.rclone}|{go_version()}|recipe={S3_RECIPE}".encode())
    for name in ("go.mod", "go.sum", "main.go"):
        h.update((S3_MODULE_DIR / name).read_bytes())
    return lab_home(v) / "s3" / h.hexdigest()[:16]


def find_s3_server(v: Versions | None = None) -> Path | None:
    """The built S3 server binary, or None when it has not been built."""
    v = v or load_versions()
    if not v.rclone:
        return None
    home = s3_server_home(v)
    binary = home / "bin" / S3_BINARY
    return binary if (home / "build.json").is_file() and binary.is_file() else None


def build_s3_server(force: bool = False, say=None) -> Path | None:
    """Build (or reuse) the S3 server for RCLONE_VERSION; None when versions.env pins none."""
    say = say or (lambda msg: print(f"[lab build] {msg}", file=sys.stderr, flush=True))
    v = load_versions()
    if not v.rclone:
        say("no RCLONE_VERSION in versions.env: no S3 server")
        return None
    existing = find_s3_server(v)
    if existing and not force:
        say(f"reusing {existing}")
        return existing
    check_s3_module(v)
    home = s3_server_home(v)
    ldflags = f"-s -w -X github.com/rclone/rclone/fs.Version={v.rclone}"

    def steps(staging: Path, log, timed) -> None:
        timed(S3_BINARY, lambda: _run(["go", "build", "-trimpath", "-buildvcs=false", f"-ldflags={ldflags}",
                                       "-o", str(staging / "bin" / S3_BINARY), "."], S3_MODULE_DIR, dict(os.environ), log))

    _cached_build(home, f"the S3 server (rclone {v.rclone} serve s3)", lambda: find_s3_server(v), force, say, steps,
                  {"rclone": v.rclone})
    return home / "bin" / S3_BINARY


def publish(staging: Path, home: Path) -> None:
    """Move a finished build into place (replacing a stale one), so a reader sees all of it or none."""
    if home.exists():
        shutil.rmtree(home)
    staging.rename(home)


def _go_installs(bindir: Path, installs: dict[str, tuple[str, str]], env: dict, log, timed) -> None:
    """`go install module@version` for each name -> (spec, ldflags): with the dependencies its release pinned."""
    for name, (spec, ldflags) in installs.items():
        def install(spec=spec, ldflags=ldflags) -> None:
            with tempfile.TemporaryDirectory() as cwd:
                _run(["go", "install", "-trimpath", f"-ldflags={ldflags}", spec], Path(cwd),
                     {**env, "GOBIN": str(bindir)}, log)
        timed(name, install)


def _cached_build(home: Path, what: str, find, force: bool, say, steps, manifest: dict) -> Installation:
    """What the optional builds share: one builder at a time (the cache's lock; `find` is asked again
    after waiting for it), `steps(staging, log, timed)` into a staging directory beside `home` with
    bin/ made, a log, build.json (`manifest` + seconds per step), then moved into place."""
    root = cache_root()
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not force and (existing := find()):
            return existing
        home.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f"{home.name}.partial-", dir=home.parent))
        log_path = home.parent / f"{home.name}.build.log"
        say(f"building {what} into {home} (log: {log_path})")
        t0 = time.monotonic()
        timings: dict[str, float] = {}
        timed = _timer(timings, say)
        try:
            (staging / "bin").mkdir()
            with open(log_path, "w") as log:
                steps(staging, log, timed)
            manifest = {**manifest, "go": go_version(), "seconds": timings,
                        "total_seconds": round(time.monotonic() - t0, 1),
                        "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
            (staging / "build.json").write_text(json.dumps(manifest, indent=2) + "\n")
            publish(staging, home)
        finally:
            if staging.exists():
                shutil.rmtree(staging, ignore_errors=True)
        say(f"{what} ready in {manifest['total_seconds']:.0f}s: {home}")
        return Installation(home)


# ---------------------------------------------------------------------------
# Optional components: JobSet, Kubeflow Trainer v2 and Kueue (`up --with trainer-v2,kueue`)
# ---------------------------------------------------------------------------

JOBSET_MODULE_DIR = Path(__file__).resolve().parent / "jobset"
JOBSET_MODULE = "sigs.k8s.io/jobset"
TRAINER_MODULE = "github.com/kubeflow/trainer/v2"
KUEUE_MODULE = "sigs.k8s.io/kueue"
V2_BINARIES = ("jobset", "trainer-controller-manager", "kueue")
V2_RECIPE = 2
# Upstream files copied from the Go module cache into <v2 home>/share/ (never into the repository):
# (module, path in the module, name under share/); a path ending in "/" copies its *.yaml files.
V2_SHARE = (
    (JOBSET_MODULE, "config/components/crd/bases/", "jobset-crds"),
    (JOBSET_MODULE, "config/components/webhook/manifests.yaml", "jobset-webhooks.yaml"),
    (JOBSET_MODULE, "config/components/webhook/patches/", "jobset-webhook-patches"),
    (TRAINER_MODULE, "manifests/base/crds/", "trainer-crds"),
    (TRAINER_MODULE, "manifests/base/webhook/manifests.yaml", "trainer-webhooks.yaml"),
    (KUEUE_MODULE, "config/components/crd/bases/", "kueue-crds"),
    (KUEUE_MODULE, "config/components/webhook/manifests.yaml", "kueue-webhooks.yaml"),
)


def check_jobset_module(v: Versions) -> None:
    """jobset/go.mod must require the JobSet that versions.env pins."""
    import re

    go_mod = (JOBSET_MODULE_DIR / "go.mod").read_text()
    m = re.search(rf"^\s*{re.escape(JOBSET_MODULE)} (v\S+)", go_mod, re.MULTILINE)
    declared = m.group(1) if m else None
    if declared != v.jobset:
        raise BuildError(
            f"e2e/lab/jobset/go.mod requires jobset {declared} but versions.env says JOBSET_VERSION={v.jobset};"
            f" run `go get -tool {JOBSET_MODULE}@{v.jobset} && go mod tidy` in e2e/lab/jobset, commit go.mod and go.sum"
        )


def v2_home(v: Versions | None = None) -> Path:
    """<lab home>/v2/<key>: keyed by the three versions, the JobSet tools module and the Go version."""
    import hashlib

    v = v or load_versions()
    h = hashlib.sha256(f"jobset={v.jobset}|trainer={v.trainer}|kueue={v.kueue}|{go_version()}|recipe={V2_RECIPE}".encode())
    for name in ("go.mod", "go.sum"):
        h.update((JOBSET_MODULE_DIR / name).read_bytes())
    return lab_home(v) / "v2" / h.hexdigest()[:16]


def find_v2(v: Versions | None = None) -> Installation | None:
    """The built JobSet, Trainer v2 and Kueue (bin/, share/), or None when not built (or not pinned)."""
    v = v or load_versions()
    if not (v.jobset and v.trainer and v.kueue):
        return None
    inst = Installation(v2_home(v))
    if not (inst.home / "build.json").is_file() or any(not (inst.bin / b).is_file() for b in V2_BINARIES):
        return None
    return inst


def build_v2(force: bool = False, say=None) -> Installation | None:
    """Build (or reuse) JobSet, Kubeflow Trainer v2 and Kueue; None when versions.env pins them not."""
    say = say or (lambda msg: print(f"[lab build] {msg}", file=sys.stderr, flush=True))
    v = load_versions()
    if not (v.jobset and v.trainer and v.kueue):
        say("versions.env pins no JOBSET/TRAINER/KUEUE_VERSION: no Trainer v2 or Kueue")
        return None
    if not force and (existing := find_v2(v)):
        say(f"reusing {existing.home}")
        return existing
    check_jobset_module(v)
    env = dict(os.environ)

    def steps(staging: Path, log, timed) -> None:
        bindir = staging / "bin"
        # JobSet's module answers no version list through the proxy here, so
        # `go install sigs.k8s.io/jobset@vX` fails; the tools module requires it instead.
        timed("jobset", lambda: _run(
            ["go", "build", "-trimpath", "-buildvcs=false",
             f"-ldflags=-s -w -X {JOBSET_MODULE}/pkg/version.GitVersion={v.jobset}",
             "-o", str(bindir / "jobset"), JOBSET_MODULE],
            JOBSET_MODULE_DIR, env, log))
        _go_installs(bindir, {
            "trainer-controller-manager": (f"{TRAINER_MODULE}/cmd/trainer-controller-manager@{v.trainer}", "-s -w"),
            "kueue": (f"{KUEUE_MODULE}/cmd/kueue@{v.kueue}", f"-s -w -X {KUEUE_MODULE}/pkg/version.GitVersion={v.kueue}"),
        }, env, log, timed)
        share = staging / "share"
        share.mkdir()
        versions_of = {JOBSET_MODULE: v.jobset, TRAINER_MODULE: v.trainer, KUEUE_MODULE: v.kueue}
        for module, rel, target in V2_SHARE:
            src = module_dir(module, versions_of[module], env) / rel
            if rel.endswith("/"):
                (share / target).mkdir()
                for f in sorted(src.glob("*.yaml")):
                    if f.name != "kustomization.yaml":  # kustomize's, not a manifest
                        shutil.copyfile(f, share / target / f.name)
            else:
                shutil.copyfile(src, share / target)

    return _cached_build(v2_home(v), f"JobSet {v.jobset}, Trainer {v.trainer}, Kueue {v.kueue}",
                         lambda: find_v2(v), force, say, steps,
                         {"versions": {"jobset": v.jobset, "trainer": v.trainer, "kueue": v.kueue}})


# ---------------------------------------------------------------------------
# The real node (`up --with kubelet`): kubelet, kube-proxy, crictl, CoreDNS and the pause binary
# ---------------------------------------------------------------------------

NODE_BINARIES = ("kubelet", "kube-proxy", "crictl", "coredns", "pause", "lab-gpu-plugin")
NODE_RECIPE = 2
# The lab's `nvidia.com/gpu` device plugin: a small main module of its own (gpuplugin/main.go).
GPU_PLUGIN_DIR = Path(__file__).resolve().parent / "gpuplugin"
CRICTL_MODULE = "sigs.k8s.io/cri-tools"
COREDNS_MODULE = "github.com/coredns/coredns"
# The sandbox's one process, from the kubernetes module at KUBERNETES_VERSION; compiled static so the
# pause image needs nothing else (e2e/lab/images.py packs it).
PAUSE_SOURCE = "build/pause/linux/pause.c"


def node_home(v: Versions | None = None) -> Path:
    """<lab home>/node/<key>: inside the lab's directory (whose key already covers kubelet's and
    kube-proxy's dependencies through tools/go.sum), keyed by crictl's and CoreDNS's versions."""
    import hashlib

    v = v or load_versions()
    h = hashlib.sha256(f"crictl={v.crictl}|coredns={v.coredns}|{go_version()}|recipe={NODE_RECIPE}".encode())
    for name in ("go.mod", "go.sum", "main.go"):
        h.update((GPU_PLUGIN_DIR / name).read_bytes())
    return lab_home(v) / "node" / h.hexdigest()[:16]


def find_node(v: Versions | None = None) -> Installation | None:
    """The built node binaries (bin/), or None when not built (or versions.env pins no crictl/CoreDNS)."""
    v = v or load_versions()
    if not (v.crictl and v.coredns):
        return None
    inst = Installation(node_home(v))
    if not (inst.home / "build.json").is_file() or any(not (inst.bin / b).is_file() for b in NODE_BINARIES):
        return None
    return inst


def build_node(force: bool = False, say=None) -> Installation:
    """Build (or reuse) the real node's binaries; the Kubernetes lab must be buildable (same tools module)."""
    say = say or (lambda msg: print(f"[lab build] {msg}", file=sys.stderr, flush=True))
    v = load_versions()
    if not (v.crictl and v.coredns):
        raise BuildError("versions.env pins no CRICTL_VERSION/COREDNS_VERSION: no real node")
    if not force and (existing := find_node(v)):
        say(f"reusing {existing.home}")
        return existing
    check_tools_module(v)
    if shutil.which("gcc") is None:
        raise BuildError("gcc not found: the pause binary is compiled from the kubernetes module's pause.c"
                         " (`apt-get install -y gcc libc6-dev`)")
    env = dict(os.environ)

    def steps(staging: Path, log, timed) -> None:
        bindir = staging / "bin"
        timed("kubelet, kube-proxy", lambda: _run(
            ["go", "build", "-trimpath", "-buildvcs=false", f"-ldflags={_ldflags_for_kubernetes(v)}",
             "-o", str(bindir) + "/", *toolsmod.NODE_COMMANDS], TOOLS_DIR, env, log))
        _go_installs(bindir, {
            "crictl": (f"{CRICTL_MODULE}/cmd/crictl@{v.crictl}", f"-s -w -X {CRICTL_MODULE}/pkg/version.Version={v.crictl}"),
            "coredns": (f"{COREDNS_MODULE}@{v.coredns}", "-s -w"),
        }, {**env, "CGO_ENABLED": "0"}, log, timed)
        pause_c = module_dir("k8s.io/kubernetes", v.kubernetes, env) / PAUSE_SOURCE
        timed("pause", lambda: _run(
            ["gcc", "-Os", "-Wall", "-Werror", "-static", f"-DVERSION={v.kubernetes}", "-o",
             str(bindir / "pause"), str(pause_c)], staging, env, log))
        timed("lab GPU device plugin", lambda: _run(
            ["go", "build", "-trimpath", "-buildvcs=false", "-ldflags=-s -w", "-o", str(bindir / "lab-gpu-plugin"), "."],
            GPU_PLUGIN_DIR, {**env, "CGO_ENABLED": "0"}, log))

    return _cached_build(node_home(v), f"kubelet, kube-proxy, crictl {v.crictl}, CoreDNS {v.coredns}, pause, the lab GPU plugin",
                         lambda: find_node(v), force, say, steps,
                         {"versions": {"kubernetes": v.kubernetes, "crictl": v.crictl, "coredns": v.coredns}})

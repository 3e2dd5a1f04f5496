"""python -m e2e.lab build|up|down|status|sync-tools|versions

    build        build the binaries for versions.env, or reuse the cached ones
    up           start a lab in a temporary directory (prints the KUBECONFIG to use);
                 --with trainer-v2,kueue adds JobSet + Kubeflow Trainer v2 and Kueue,
                 --without-pytorchjob leaves out the PyTorchJob CRD and the training operator
    down         stop the lab that `up` started (or --workdir DIR), by pid
    status       which processes of that lab are alive
    sync-tools   regenerate tools/go.mod and go.sum from versions.env (needs the Go proxy)
    versions     print the pinned versions and the cache directory
    prune        delete cached builds other than the current one
    images       build the operator and trainer images from their Dockerfiles (mmdebstrap + umoci,
                 no docker, no registry), or reuse the cached ones; see e2e/lab/images.py
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from . import build as lab_build
from . import toolsmod
from .versions import TOOLS_DIR, cache_root, load_versions

CURRENT = "current-lab"


def _current_workdir(arg: str | None) -> Path:
    if arg:
        return Path(arg)
    pointer = cache_root() / CURRENT
    if not pointer.exists():
        sys.exit("no lab recorded as started by `up`; pass --workdir")
    return Path(pointer.read_text().strip())


def cmd_build(args) -> int:
    t0 = time.monotonic()
    inst = lab_build.build(force=args.force)
    if args.with_components and "kubelet" in args.with_components.split(","):
        lab_build.build_node(force=args.force)
    print(json.dumps({"home": str(inst.home), "seconds": round(time.monotonic() - t0, 1), **inst.manifest()}, indent=2))
    return 0


def cmd_up(args) -> int:
    from .cluster import up

    if args.build:
        lab_build.build()
        if args.with_components and "kubelet" in args.with_components.split(","):
            lab_build.build_node()
    lab = up(Path(args.workdir) if args.workdir else None, components=args.with_components,
             pytorchjob=not args.without_pytorchjob)
    if not args.workdir:
        # Recorded so that `status` and `down` find it; a lab with an explicit --workdir is
        # addressed by that directory instead (and leaves a developer's current lab alone).
        cache_root().mkdir(parents=True, exist_ok=True)
        (cache_root() / CURRENT).write_text(str(lab.workdir) + "\n")
    print(f"export KUBECONFIG={lab.kubeconfig}")
    print(f"export PATH={lab.installation.bin}:$PATH")
    return 0


def cmd_down(args) -> int:
    from .cluster import Lab

    workdir = _current_workdir(args.workdir)
    if not (workdir / "lab.json").exists():
        print(f"no lab in {workdir}")
        return 0
    lab = Lab.load(workdir)
    killed = lab.down(keep_workdir=args.keep)
    pointer = cache_root() / CURRENT
    if pointer.exists() and pointer.read_text().strip() == str(workdir):
        pointer.unlink()
    print(f"stopped {len(lab.procs)} processes" + (f" (SIGKILL needed: {', '.join(killed)})" if killed else ""))
    return 0


def cmd_status(args) -> int:
    from .cluster import Lab

    workdir = _current_workdir(args.workdir)
    lab = Lab.load(workdir)
    alive = lab.status()
    for name, ok in alive.items():
        print(f"{name:26s} {'running' if ok else 'STOPPED'}")
    print(f"KUBECONFIG={lab.kubeconfig}")
    return 0 if all(alive.values()) else 1


def cmd_sync_tools(args) -> int:
    v = load_versions()
    env = dict(os.environ)
    kdir = lab_build.module_dir("k8s.io/kubernetes", v.kubernetes, env)
    staging = toolsmod.staging_modules((kdir / "go.mod").read_text())
    go_directive = _go_directive((kdir / "go.mod").read_text())
    (TOOLS_DIR / "go.mod").write_text(toolsmod.render_go_mod(v, staging, go_directive))
    (TOOLS_DIR / "go.sum").unlink(missing_ok=True)
    subprocess.run(["go", "mod", "tidy"], cwd=TOOLS_DIR, check=True)
    lab_build.check_tools_module(v)
    print(f"tools/go.mod synced to {v}")
    return 0


def _go_directive(go_mod: str) -> str:
    for line in go_mod.splitlines():
        if line.startswith("go "):
            return line.split()[1]
    return "1.24"


def cmd_prune(args) -> int:
    """Delete cached builds other than the current one (skipping any a running process uses)."""
    import shutil

    keep = lab_build.lab_home().name
    in_use = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    for entry in sorted(cache_root().iterdir()) if cache_root().exists() else []:
        if not entry.is_dir() or entry.name == keep:
            continue
        if str(entry) in in_use:
            print(f"kept {entry} (in use by a running process)")
            continue
        shutil.rmtree(entry, ignore_errors=True)
        print(f"removed {entry}")
    return 0


def cmd_images(args) -> int:
    from . import images

    t0 = time.monotonic()
    built = images.build_all(force=args.force, only=tuple(args.only or ()))
    print(json.dumps({
        "seconds": round(time.monotonic() - t0, 1),
        "images": [{"image": b.spec.name, "names": list(b.spec.names), "archive": str(b.archive),
                    "built_seconds": b.manifest()["seconds"], "base": b.manifest()["base"]} for b in built],
    }, indent=2))
    return 0


def cmd_versions(args) -> int:
    v = load_versions()
    inst = lab_build.find_installation(v)
    print(json.dumps({
        "versions": {k: getattr(v, k) for k in v.__dataclass_fields__},
        "go": lab_build.go_version(),
        "cache": str(lab_build.lab_home(v)),
        "built": inst is not None,
        "v2 (jobset, trainer, kueue)": {
            "cache": str(lab_build.v2_home(v)) if v.jobset and v.trainer and v.kueue else None,
            "built": lab_build.find_v2(v) is not None,
        },
    }, indent=2))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m e2e.lab", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="build or reuse the cached binaries")
    b.add_argument("--force", action="store_true", help="rebuild even if cached")
    b.add_argument("--with", dest="with_components", default=None,
                   help="also build an optional component's binaries: kubelet (the real node)")
    b.set_defaults(fn=cmd_build)
    u = sub.add_parser("up", help="start a lab")
    u.add_argument("--workdir")
    u.add_argument("--build", action="store_true", help="build first if needed")
    u.add_argument("--with", dest="with_components", default=os.environ.get("FINETUNE_LAB_WITH"),
                   help="optional components, comma-separated: trainer-v2 (JobSet + Kubeflow Trainer v2), kueue,"
                        " kubelet (a real node: containerd, CNI bridge, kube-proxy, CoreDNS)"
                        " (default: $FINETUNE_LAB_WITH)")
    u.add_argument("--without-pytorchjob", action="store_true",
                   help="no PyTorchJob CRD and no training operator (a cluster with only TrainJob)")
    u.set_defaults(fn=cmd_up)
    d = sub.add_parser("down", help="stop a lab")
    d.add_argument("--workdir")
    d.add_argument("--keep", action="store_true", help="keep the directory (logs)")
    d.set_defaults(fn=cmd_down)
    s = sub.add_parser("status", help="show the lab's processes")
    s.add_argument("--workdir")
    s.set_defaults(fn=cmd_status)
    sub.add_parser("sync-tools", help="regenerate tools/go.mod from versions.env").set_defaults(fn=cmd_sync_tools)
    sub.add_parser("versions", help="print the pinned versions").set_defaults(fn=cmd_versions)
    im = sub.add_parser("images", help="build the operator and trainer images from their Dockerfiles")
    im.add_argument("--force", action="store_true", help="rebuild even if cached")
    im.add_argument("--only", action="append", choices=("operator", "trainer"), help="build only this image")
    im.set_defaults(fn=cmd_images)
    sub.add_parser("prune", help="delete cached builds of other versions").set_defaults(fn=cmd_prune)
    args = parser.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())

"""The project's images built from their Dockerfiles' own instructions, without docker or a registry.

    python -m e2e.lab images            # build (or reuse) both images; prints names, keys, seconds
    python -m e2e.lab images --force    # rebuild even if cached

Each Dockerfile is read by e2e/lab/dockerfile.py and followed step by step in a Debian bookworm root
filesystem made by mmdebstrap:

- FROM     -> the lab base named for that FROM in BASES (an error names the FROM when there is none);
- ENV, WORKDIR, USER -> kept as the image's config and applied to the RUN steps after them;
- COPY     -> the files from the repository (the build context; .dockerignore applies), owned by root;
- RUN      -> run in the root filesystem (chroot in a private mount namespace, so its mounts vanish with
              it), as the USER in effect, with the host's CA bundle for pip (TLS is intercepted here);
- ENTRYPOINT / CMD -> the image's config.

umoci turns the root filesystem into a one-layer OCI image; the archive's index names it under the
names the chart and the renderer use (image_names()), so `ctr -n k8s.io images import` makes it
available on a lab node and pods with `imagePullPolicy: IfNotPresent` never pull.

The trainer image is the lab's, not the release's: its FROM (pytorch/pytorch, the CUDA build: about
10 minutes and 20 GB per build here) becomes a Debian base with a virtual environment over the host's
own Python (torch, transformers, DeepSpeed, ...), which RUN steps and, later, pods see read-only at the
same path (HOST_PYTHON_LABEL says where): the installation and, when the lab runs in a virtual environment,
that environment too (a .pth file of /opt/venv names its site-packages). Its RUN step still installs the project from the copied files
into that environment, and bitsandbytes from PyPI. The operator image is complete: everything it runs is
inside it.

Everything is cached under ~/.cache/finetune-operator/images/ by a content key: the recipe, the base's
packages, the Dockerfile's instructions, every copied file's bytes and place, and (trainer) the host
Python's version and installed distributions. A warm build only checks that the key's build.json exists.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from .build import publish
from .dockerfile import REPO_ROOT, Instruction, copy_of, parse, source_files
from .versions import cache_root

SUITE = "bookworm"
MIRROR = "http://deb.debian.org/debian"
# Bumped when the way images are built changes, so a changed recipe never reuses an old image.
RECIPE = 1
HOST_CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")
# Where RUN steps see the host's CA bundle (never part of the image).
BUILD_CA = "/run/lab-build-ca.crt"
HOST_PYTHON_LABEL = "dev.finetune.lab/host-python"
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


class ImageBuildError(RuntimeError):
    pass


def host_python_prefix() -> Path:
    """The host interpreter's installation (its lib/, bin/, site-packages), mounted read-only."""
    return Path(sys.base_prefix)


def host_python_paths() -> tuple[Path, ...]:
    """What of the host's Python is mounted read-only at its own path: the installation and, where
    this runs in a virtual environment (where torch & co. are then installed), that environment."""
    from finetune_operator.rendering import layout

    prefixes = tuple(dict.fromkeys([host_python_prefix(), Path(sys.prefix)]))
    # The pods mount volumes of their own over these (the scratch emptyDir at /tmp, ...): a host
    # Python below one would be hidden in every training container.
    covered = [layout.SCRATCH_DIR, layout.SHM_DIR, layout.CONFIG_DIR, "/mnt"]
    for prefix in prefixes:
        for path in covered:
            if prefix == Path(path) or Path(path) in prefix.parents:
                raise ImageBuildError(
                    f"the host's Python at {prefix} lies below {path}, where the training pods mount a volume of"
                    f" their own that would hide it: put the virtual environment (or Python) elsewhere")
    return prefixes


def host_venv_site_packages() -> tuple[str, ...]:
    """The host virtual environment's site-packages (none outside one): the image's /opt/venv reads
    them through a .pth file, after its own and before the installation's."""
    if Path(sys.prefix) == host_python_prefix():
        return ()
    paths = sysconfig.get_paths()
    return tuple(dict.fromkeys([paths["purelib"], paths["platlib"]]))


@dataclass(frozen=True)
class Base:
    """What a Dockerfile's FROM becomes in the lab."""

    packages: tuple[str, ...]
    # Run as root in the root filesystem right after mmdebstrap (part of the base's cache key).
    setup: str
    env: tuple[tuple[str, str], ...] = ()
    host_python: bool = False  # RUN steps (and pods) see the host's Python read-only at its own path
    why: str = ""


_PYTHON_SLIM = Base(
    packages=("python3", "python3-pip", "python3-venv", "python-is-python3", "ca-certificates"),
    # Like the python image: a system Python that `pip install` installs into (Debian marks its
    # Python externally managed, PEP 668; an image has no apt-installed Python packages to protect).
    setup="rm -f /usr/lib/python3*/EXTERNALLY-MANAGED",
    why="Debian bookworm's python3 (3.11.2) with pip, in place of python:3.11.7-slim-bookworm",
)


def _venv_over_host_python() -> Base:
    prefix = host_python_prefix()
    return Base(
        # The shared libraries the host's Python and its wheels (torch, ...) load from the system.
        packages=("ca-certificates", "libbz2-1.0", "libcrypt1", "libexpat1", "libffi8", "libgcc-s1", "libgdbm6",
                  "libgomp1", "liblzma5", "libncursesw6", "libreadline8", "libsqlite3-0", "libssl3", "libstdc++6",
                  "libtinfo6", "libtirpc3", "libuuid1", "zlib1g"),
        # The mount point for the host's Python, traversable by the pods' uid 1000 (it may lie under /root).
        setup="; ".join([
            *[f"mkdir -p {shlex.quote(str(path))}" for path in host_python_paths()],
            *[f"chmod 0755 {shlex.quote(str(p))}" for path in host_python_paths()
              for p in reversed(path.parents) if str(p) != "/"],
            "chmod 0755 /root",
        ]),
        env=(("PATH", f"/opt/venv/bin:{DEFAULT_PATH}"),),
        host_python=True,
        why=(f"Debian bookworm with a virtual environment (/opt/venv) over the host's Python at {prefix},"
             " mounted read-only, in place of pytorch/pytorch (the CUDA build: ~10 min and 20 GB per build here)"),
    )


def base_for(image_from: str) -> Base:
    if image_from.startswith("python:") and image_from.endswith("-bookworm"):
        return _PYTHON_SLIM
    if image_from.startswith("pytorch/pytorch:"):
        return _venv_over_host_python()
    raise ImageBuildError(f"the lab has no base for `FROM {image_from}`; add one to e2e/lab/images.py base_for()")


# The trainer's base creates its virtual environment once the host's Python is mounted (a RUN step of
# its own, before the Dockerfile's): the project installs into it, torch & co. are the host's. Without
# ensurepip's pip and setuptools (an old setuptools there would shadow the host's for
# --no-build-isolation builds); `pip` is the host's pip, run by the venv's interpreter.
VENV_SETUP = ("{python} -m venv --system-site-packages --without-pip /opt/venv"
              " && printf '#!/bin/sh\\nexec /opt/venv/bin/python -m pip \"$@\"\\n' > /opt/venv/bin/pip"
              " && chmod 0755 /opt/venv/bin/pip")


@dataclass(frozen=True)
class ImageSpec:
    name: str  # operator | trainer
    dockerfile: Path
    names: tuple[str, ...]  # what the image is imported as


def image_names() -> dict[str, tuple[str, ...]]:
    """The names the chart and the renderer use, read from where they are set (never repeated here)."""
    from finetune_operator.planning.policy import DEFAULT_TRAINER_IMAGE

    chart = REPO_ROOT / "charts" / "finetune-operator"
    values = yaml.safe_load((chart / "values.yaml").read_text())
    app_version = yaml.safe_load((chart / "Chart.yaml").read_text())["appVersion"]
    operator = f"{values['image']['repository']}:{values['image']['tag'] or app_version}"
    t = values["policy"]["trainer"]
    trainer = f"{t['registry']}/{t['repository']}:{t['tag']}"
    return {"operator": (operator,), "trainer": tuple(dict.fromkeys((trainer, DEFAULT_TRAINER_IMAGE)))}


def specs() -> list[ImageSpec]:
    names = image_names()
    return [ImageSpec(n, REPO_ROOT / "images" / n / "Dockerfile", names[n]) for n in ("operator", "trainer")]


def images_root() -> Path:
    return cache_root().parent / "images"


# ---- the base root filesystem (mmdebstrap) ------------------------------------------------------------

def _tool_version(cmd: list[str]) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout.strip().splitlines()[0]
    except (OSError, IndexError, subprocess.SubprocessError):
        return "missing"


def _need_tools() -> None:
    missing = [t for t in ("mmdebstrap", "umoci", "unshare", "chroot") if shutil.which(t) is None]
    if missing:
        raise ImageBuildError(
            f"{', '.join(missing)} not found: `apt-get install -y mmdebstrap umoci` (Debian bookworm) builds the lab's images")
    if os.geteuid() != 0:
        raise ImageBuildError("the lab's image builder runs as root (mmdebstrap, chroot and umoci unpack need it)")


def base_key(base: Base) -> str:
    h = hashlib.sha256(json.dumps({"suite": SUITE, "mirror": MIRROR, "packages": base.packages,
                                   "setup": base.setup, "recipe": RECIPE,
                                   "mmdebstrap": _tool_version(["mmdebstrap", "--version"])}).encode())
    return h.hexdigest()[:16]


def ensure_base(base: Base, say) -> Path:
    """A tarball of the base root filesystem, built once per base key."""
    root = images_root()
    root.mkdir(parents=True, exist_ok=True)
    tar = root / f"base-{base_key(base)}.tar"
    if tar.is_file():
        return tar
    say(f"mmdebstrap {SUITE} with {', '.join(base.packages)} ...")
    t0 = time.monotonic()
    partial = tar.with_suffix(f".partial{os.getpid()}.tar")
    with tempfile.TemporaryDirectory(dir=root) as work:
        log = Path(work) / "mmdebstrap.log"
        hook = f'chroot "$1" /bin/sh -c {shlex.quote(base.setup)}' if base.setup else None
        cmd = ["mmdebstrap", "--variant=minbase", f"--include={','.join(base.packages)}",
               "--aptopt=Acquire::Retries 3", "--format=tar"]
        if hook:
            cmd.append(f"--customize-hook={hook}")
        cmd += [SUITE, str(partial), MIRROR]
        with open(log, "w") as out:
            proc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT)
        if proc.returncode != 0:
            partial.unlink(missing_ok=True)
            raise ImageBuildError(f"mmdebstrap failed (exit {proc.returncode}):\n{log.read_text()[-3000:]}")
    partial.replace(tar)
    say(f"base root filesystem in {time.monotonic() - t0:.0f}s: {tar}")
    return tar


# ---- following a Dockerfile ---------------------------------------------------------------------------

@dataclass
class ImageConfig:
    """What the Dockerfile says about the image besides its files (OCI image config)."""

    env: dict[str, str] = field(default_factory=dict)
    workdir: str = "/"
    user: str = "0:0"
    entrypoint: list[str] = field(default_factory=list)
    cmd: list[str] = field(default_factory=list)
    labels: dict[str, str] = field(default_factory=dict)


def parse_env(ins: Instruction) -> dict[str, str]:
    words = shlex.split(ins.text)
    if not words or any("=" not in w for w in words):
        raise ImageBuildError(f"line {ins.line}: only `ENV KEY=VALUE ...` is supported, got {ins.text!r}")
    return dict(w.split("=", 1) for w in words)


def parse_user(ins: Instruction) -> str:
    uid, _, gid = ins.text.strip().partition(":")
    if not uid.isdigit() or (gid and not gid.isdigit()):
        raise ImageBuildError(f"line {ins.line}: USER must be numeric (uid[:gid]) for the lab's builder, got {ins.text!r}")
    return f"{uid}:{gid or uid}"


def _command(ins: Instruction) -> list[str]:
    return ins.exec_form() or ["/bin/sh", "-c", ins.text]


def _host_python_fingerprint() -> dict:
    """What of the host's Python a trainer image depends on: its version and installed distributions."""
    site = Path(sysconfig.get_paths()["purelib"])
    dists = sorted(p.name for p in site.glob("*.dist-info"))
    return {"prefix": str(host_python_prefix()), "paths": [str(p) for p in host_python_paths()],
            "version": sys.version, "dists": dists}


def image_key(spec: ImageSpec) -> str:
    """The content key: recipe, base, every instruction, and every copied file's bytes and place."""
    instructions = parse(spec.dockerfile.read_text())
    base = base_for(instructions[0].text)
    h = hashlib.sha256(f"recipe={RECIPE}|base={base_key(base)}|names={spec.names}\n".encode())
    for ins in instructions:
        h.update(f"{ins.keyword} {ins.text}\n".encode())
        if ins.keyword == "COPY":
            for src, rel in source_files(copy_of(ins)):
                h.update(f"{src.relative_to(REPO_ROOT)}>{rel}|{oct(src.stat().st_mode & 0o777)}\n".encode())
                h.update(hashlib.sha256(src.read_bytes()).digest())
    if base.host_python:
        h.update(json.dumps(_host_python_fingerprint()).encode())
    return h.hexdigest()[:16]


@dataclass(frozen=True)
class BuiltImage:
    spec: ImageSpec
    home: Path  # <images root>/<name>-<key>

    @property
    def archive(self) -> Path:
        return self.home / "image.tar"

    def manifest(self) -> dict:
        return json.loads((self.home / "build.json").read_text())


def find_image(spec: ImageSpec) -> BuiltImage | None:
    img = BuiltImage(spec, images_root() / f"{spec.name}-{image_key(spec)}")
    return img if (img.home / "build.json").is_file() and img.archive.is_file() else None


def _in_root(rootfs: Path, path: str) -> Path:
    return rootfs / path.lstrip("/")


def _run_step(rootfs: Path, argv: list[str], config: ImageConfig, base: Base, log) -> None:
    """One RUN: chroot into the root filesystem inside a private mount namespace (`unshare -m`), with
    /proc, /dev, the host's resolv.conf and CA bundle (and, for the trainer, the host's Python read-only)
    mounted only for its duration."""
    env = {"PATH": DEFAULT_PATH, "HOME": "/root" if config.user.startswith("0:") else "/", **config.env,
           "PIP_CERT": BUILD_CA, "SSL_CERT_FILE": BUILD_CA, "REQUESTS_CA_BUNDLE": BUILD_CA,
           "PIP_ROOT_USER_ACTION": "ignore"}
    mounts = [
        f"mount -t proc proc {shlex.quote(str(rootfs / 'proc'))}",
        f"mount --rbind /dev {shlex.quote(str(rootfs / 'dev'))}",
        f"touch {shlex.quote(str(_in_root(rootfs, BUILD_CA)))}",
        f"mount --bind -o ro {HOST_CA_BUNDLE} {shlex.quote(str(_in_root(rootfs, BUILD_CA)))}",
        f"mount --bind -o ro /etc/resolv.conf {shlex.quote(str(rootfs / 'etc' / 'resolv.conf'))}",
    ]
    if base.host_python:
        for path in host_python_paths():
            target = shlex.quote(str(_in_root(rootfs, str(path))))
            mounts += [f"mkdir -p {target}", f"mount --bind {shlex.quote(str(path))} {target}",
                       f"mount -o remount,bind,ro {target}"]
    workdir = config.workdir
    inner = " ".join(["cd", shlex.quote(workdir), "&&", "exec", "env", "-i",
                      *[shlex.quote(f"{k}={v}") for k, v in env.items()], *map(shlex.quote, argv)])
    script = "set -e; " + "; ".join(mounts) + "; " + " ".join([
        "exec", "chroot", f"--userspec={config.user}",
        shlex.quote(str(rootfs)), "/bin/sh", "-c", shlex.quote(inner)])
    log.write(f"$ RUN {argv}\n")
    log.flush()
    # resolv.conf must exist as a mount point.
    (rootfs / "etc" / "resolv.conf").unlink(missing_ok=True)
    (rootfs / "etc" / "resolv.conf").touch()
    proc = subprocess.run(["unshare", "--mount", "--propagation", "private", "--fork", "/bin/sh", "-c", script],
                          stdout=log, stderr=subprocess.STDOUT)
    (rootfs / "etc" / "resolv.conf").unlink(missing_ok=True)
    _in_root(rootfs, BUILD_CA).unlink(missing_ok=True)
    if proc.returncode != 0:
        raise ImageBuildError(f"RUN {' '.join(argv)[:200]} failed (exit {proc.returncode}); see {log.name}")


def _copy_step(rootfs: Path, ins: Instruction, config: ImageConfig) -> None:
    c = copy_of(ins)
    dest = c.dest if c.dest.startswith("/") else os.path.join(config.workdir, c.dest)
    for src, rel in source_files(c):
        target = _in_root(rootfs, os.path.normpath(os.path.join(dest, rel)) if rel else os.path.normpath(dest))
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, target)
        os.chown(target, 0, 0)


def follow(spec: ImageSpec, rootfs: Path, base_tar: Path, log, say) -> ImageConfig:
    """Apply the Dockerfile's instructions to an empty directory; returns the image config."""
    instructions = parse(spec.dockerfile.read_text())
    base = base_for(instructions[0].text)
    subprocess.run(["tar", "-xpf", str(base_tar), "-C", str(rootfs)], check=True)
    config = ImageConfig(env=dict(base.env))
    if base.host_python:
        config.labels[HOST_PYTHON_LABEL] = " ".join(str(path) for path in host_python_paths())
        python = shlex.quote(str(host_python_prefix() / "bin" / "python3"))
        setup = VENV_SETUP.format(python=python)
        if host_venv_site_packages():
            # The host's virtual environment, seen through a .pth file of /opt/venv (a venv's
            # --system-site-packages reaches only the installation's own site-packages).
            pth = "/opt/venv/lib/python{}.{}/site-packages/host-venv.pth".format(*sys.version_info[:2])
            lines = "\\n".join(host_venv_site_packages())
            setup += f" && printf '{lines}\\n' > {shlex.quote(pth)}"
        _run_step(rootfs, ["/bin/sh", "-c", setup], config, base, log)
    for ins in instructions[1:]:
        if ins.keyword == "ENV":
            config.env.update(parse_env(ins))
        elif ins.keyword == "WORKDIR":
            config.workdir = os.path.normpath(os.path.join(config.workdir, ins.text.strip()))
            _in_root(rootfs, config.workdir).mkdir(parents=True, exist_ok=True)
        elif ins.keyword == "USER":
            config.user = parse_user(ins)
        elif ins.keyword == "COPY":
            _copy_step(rootfs, ins, config)
        elif ins.keyword == "RUN":
            say(f"{spec.name}: RUN {ins.text[:80]} ...")
            t0 = time.monotonic()
            _run_step(rootfs, _command(ins), config, base, log)
            say(f"{spec.name}: RUN done in {time.monotonic() - t0:.0f}s")
        elif ins.keyword == "ENTRYPOINT":
            config.entrypoint = _command(ins)
            config.cmd = []  # as docker: a new ENTRYPOINT resets an inherited CMD
        elif ins.keyword == "CMD":
            config.cmd = _command(ins)
    # Build-time leftovers that no RUN should have left in the image.
    shutil.rmtree(rootfs / "root" / ".cache", ignore_errors=True)
    return config


def _umoci(args: list[str], log) -> None:
    log.write(f"$ umoci {' '.join(args)}\n")
    log.flush()
    proc = subprocess.run(["umoci", *args], stdout=log, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        raise ImageBuildError(f"umoci {args[0]} failed (exit {proc.returncode}); see {log.name}")


def package(rootfs: Path, config: ImageConfig, names: tuple[str, ...], out: Path, work: Path, log) -> None:
    """rootfs + config -> an OCI layout (umoci) -> out (a tar archive of it) whose index names it."""
    layout, bundle = work / "layout", work / "bundle"
    _umoci(["init", "--layout", str(layout)], log)
    _umoci(["new", "--image", f"{layout}:lab"], log)
    _umoci(["unpack", "--image", f"{layout}:lab", str(bundle)], log)
    shutil.rmtree(bundle / "rootfs")
    rootfs.rename(bundle / "rootfs")
    _umoci(["repack", "--image", f"{layout}:lab", str(bundle)], log)
    cfg = ["config", "--image", f"{layout}:lab", f"--config.user={config.user}",
           f"--config.workingdir={config.workdir}", "--clear=config.env", "--clear=config.entrypoint",
           "--clear=config.cmd"]
    cfg += [f"--config.env={k}={v}" for k, v in {"PATH": DEFAULT_PATH, **config.env}.items()]
    cfg += [f"--config.entrypoint={w}" for w in config.entrypoint]
    cfg += [f"--config.cmd={w}" for w in config.cmd]
    cfg += [f"--config.label={k}={v}" for k, v in config.labels.items()]
    _umoci(cfg, log)
    _umoci(["gc", "--layout", str(layout)], log)
    # One index entry per name: containerd's importer names each entry by this annotation.
    index = json.loads((layout / "index.json").read_text())
    entry = index["manifests"][0]
    index["manifests"] = [{**entry, "annotations": {"io.containerd.image.name": n, "org.opencontainers.image.ref.name": n}}
                          for n in names]
    (layout / "index.json").write_text(json.dumps(index))
    subprocess.run(["tar", "-cf", str(out), "-C", str(layout), "."], check=True)


def build_image(spec: ImageSpec, force: bool = False, say=None) -> BuiltImage:
    say = say or (lambda msg: print(f"[lab images] {msg}", file=sys.stderr, flush=True))
    _need_tools()
    existing = find_image(spec)
    if existing and not force:
        say(f"reusing {spec.name} {existing.home.name}")
        return existing
    root = images_root()
    root.mkdir(parents=True, exist_ok=True)
    key = image_key(spec)
    home = root / f"{spec.name}-{key}"
    with open(root / ".build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        existing = find_image(spec)
        if existing and not force:
            return existing
        t0 = time.monotonic()
        base = base_for(parse(spec.dockerfile.read_text())[0].text)
        base_tar = ensure_base(base, say)
        base_seconds = round(time.monotonic() - t0, 1)
        work = Path(tempfile.mkdtemp(prefix=f"{spec.name}-{key}.partial-", dir=root))
        log_path = root / f"{spec.name}-{key}.build.log"
        try:
            rootfs = work / "rootfs"
            rootfs.mkdir()
            with open(log_path, "w") as log:
                config = follow(spec, rootfs, base_tar, log, say)
                stage = work / "out"
                stage.mkdir()
                package(rootfs, config, spec.names, stage / "image.tar", work, log)
            manifest = {"image": spec.name, "names": list(spec.names), "key": key,
                        "dockerfile": str(spec.dockerfile.relative_to(REPO_ROOT)),
                        "base": base.why, "base_seconds": base_seconds,
                        "seconds": round(time.monotonic() - t0, 1),
                        "size_bytes": (stage / "image.tar").stat().st_size,
                        "config": {"user": config.user, "workdir": config.workdir, "entrypoint": config.entrypoint,
                                   "cmd": config.cmd, "labels": config.labels},
                        "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
            (stage / "build.json").write_text(json.dumps(manifest, indent=2) + "\n")
            publish(stage, home)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        say(f"{spec.name} image in {manifest['seconds']:.0f}s ({manifest['size_bytes'] / 2**20:.0f} MiB): {home}")
        return BuiltImage(spec, home)


def build_all(force: bool = False, only: tuple[str, ...] = (), say=None) -> list[BuiltImage]:
    return [build_image(s, force=force, say=say) for s in specs() if not only or s.name in only]


def build_pause(pause_binary: Path, name: str, say=None) -> Path:
    """The sandbox image: the static pause binary alone (build.build_node compiles it), cached by its hash.
    Returns the archive for `ctr images import`."""
    say = say or (lambda msg: print(f"[lab images] {msg}", file=sys.stderr, flush=True))
    _need_tools()
    digest = hashlib.sha256(pause_binary.read_bytes() + f"{name}|recipe={RECIPE}".encode()).hexdigest()[:16]
    home = images_root() / f"pause-{digest}"
    if (home / "image.tar").is_file():
        return home / "image.tar"
    images_root().mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f"pause-{digest}.partial-", dir=images_root()))
    try:
        rootfs = work / "rootfs"
        rootfs.mkdir()
        shutil.copy2(pause_binary, rootfs / "pause")
        stage = work / "out"
        stage.mkdir()
        with open(work / "build.log", "w") as log:
            package(rootfs, ImageConfig(user="65535:65535", entrypoint=["/pause"]), (name,), stage / "image.tar", work, log)
        publish(stage, home)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    say(f"pause image: {home}")
    return home / "image.tar"

"""The project's Dockerfiles read as data: their instructions, the files they COPY, and the project
modules those files import.

One reader for two users: the fast test that fails when a Dockerfile copies less than its code imports
(e2e/test_dockerfiles.py), and the lab's image builder (images.py), which follows the same instructions
without docker. The list of copied files is always the Dockerfile's own; nothing here repeats it.

Only the syntax the project's Dockerfiles use is accepted (one build stage, no build arguments, no
heredocs, COPY from the build context); anything else is an error naming the line, not a guess.
"""

from __future__ import annotations

import ast
import fnmatch
import json
import shlex
import tomllib
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
DOCKERFILES = (REPO_ROOT / "images" / "operator" / "Dockerfile", REPO_ROOT / "images" / "trainer" / "Dockerfile")
SUPPORTED = {"FROM", "ENV", "RUN", "WORKDIR", "COPY", "USER", "ENTRYPOINT", "CMD"}


class DockerfileError(ValueError):
    pass


@dataclass(frozen=True)
class Instruction:
    keyword: str  # upper case: FROM, RUN, COPY, ...
    text: str  # the arguments, continuation lines joined
    line: int  # where the instruction starts (1-based)

    def exec_form(self) -> list[str] | None:
        """The JSON (exec) form's words, or None for the shell form."""
        if not self.text.startswith("["):
            return None
        try:
            words = json.loads(self.text)
        except json.JSONDecodeError as exc:
            raise DockerfileError(f"line {self.line}: {self.keyword} looks like JSON but is not: {exc}") from None
        if not isinstance(words, list) or not all(isinstance(w, str) for w in words):
            raise DockerfileError(f"line {self.line}: {self.keyword} JSON form must be a list of strings")
        return words


@dataclass(frozen=True)
class Copy:
    sources: tuple[str, ...]  # relative to the build context (the repository root)
    dest: str  # as written; relative to the WORKDIR in effect when it ends without a leading /
    line: int


def parse(text: str) -> list[Instruction]:
    """Instructions in order; comments dropped, backslash continuations joined."""
    out: list[Instruction] = []
    pending: list[str] = []
    start = 0
    for lineno, raw in enumerate(text.splitlines(), 1):
        stripped = raw.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if pending and stripped.startswith("#"):
            continue  # a comment inside a continued instruction, as docker allows
        if not pending:
            start = lineno
        if stripped.endswith("\\"):
            pending.append(stripped[:-1].strip())
            continue
        pending.append(stripped)
        joined = " ".join(p for p in pending if p)
        pending = []
        keyword, _, rest = joined.partition(" ")
        keyword = keyword.upper()
        if keyword not in SUPPORTED:
            raise DockerfileError(f"line {start}: {keyword} is not supported by the lab's reader ({sorted(SUPPORTED)})")
        out.append(Instruction(keyword, rest.strip(), start))
    if pending:
        raise DockerfileError("the Dockerfile ends inside a continued line")
    if sum(1 for i in out if i.keyword == "FROM") != 1 or out[0].keyword != "FROM":
        raise DockerfileError("expected exactly one FROM, as the first instruction (one build stage)")
    return out


def copy_of(ins: Instruction) -> Copy:
    words = ins.exec_form() or shlex.split(ins.text)
    flags = [w for w in words if w.startswith("--")]
    words = [w for w in words if not w.startswith("--")]
    unsupported = [f for f in flags if not f.startswith("--chown=")]
    if unsupported:
        raise DockerfileError(f"line {ins.line}: COPY {' '.join(unsupported)} is not supported (build context only)")
    if len(words) < 2:
        raise DockerfileError(f"line {ins.line}: COPY needs at least one source and a destination")
    for src in words[:-1]:
        if any(ch in src for ch in "*?[") or src.startswith("/") or ".." in Path(src).parts:
            raise DockerfileError(f"line {ins.line}: COPY source {src!r}: only plain paths inside the context")
    return Copy(tuple(words[:-1]), words[-1], ins.line)


def copies(instructions: list[Instruction]) -> list[Copy]:
    return [copy_of(i) for i in instructions if i.keyword == "COPY"]


def ignore_patterns(context: Path = REPO_ROOT) -> list[str]:
    """The context's .dockerignore patterns (plain fnmatch patterns, `**/` prefixes; no `!`)."""
    path = context / ".dockerignore"
    if not path.is_file():
        return []
    pats = [p.strip() for p in path.read_text().splitlines() if p.strip() and not p.strip().startswith("#")]
    if any(p.startswith("!") for p in pats):
        raise DockerfileError(".dockerignore exceptions (!) are not supported by the lab's reader")
    return pats


def _ignored(rel: str, patterns: list[str]) -> bool:
    """Docker's rule for the patterns the reader accepts: `**/x` matches x at any depth, `a/b`
    matches from the context's root; a matched directory excludes everything under it."""
    parts = rel.split("/")
    prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    for pat in patterns:
        if pat.startswith("**/"):
            if any(fnmatch.fnmatchcase(p, pat[3:]) for p in parts):
                return True
        elif any(fnmatch.fnmatchcase(p, pat.rstrip("/")) for p in prefixes):
            return True
    return False


def source_files(copy: Copy, context: Path = REPO_ROOT) -> list[tuple[Path, str]]:
    """(file in the context, path relative to that COPY's destination) for every file it copies;
    a directory source copies its contents, as docker does."""
    patterns = ignore_patterns(context)
    out: list[tuple[Path, str]] = []
    for src in copy.sources:
        path = context / src
        if path.is_dir():
            for f in sorted(p for p in path.rglob("*") if p.is_file()):
                rel = f.relative_to(context).as_posix()
                if not _ignored(rel, patterns):
                    out.append((f, f.relative_to(path).as_posix()))
        elif path.is_file():
            # Several sources (or a destination ending in /) copy into the directory under their own name.
            if len(copy.sources) > 1 or copy.dest.endswith("/"):
                out.append((path, path.name))
            else:
                out.append((path, ""))
        else:
            raise DockerfileError(f"line {copy.line}: COPY source {src!r} does not exist in {context}")
    return out


def copied_files(dockerfile: Path, context: Path = REPO_ROOT) -> set[Path]:
    """Every file of the context that the Dockerfile copies into the image."""
    return {f for c in copies(parse(dockerfile.read_text())) for f, _ in source_files(c, context)}


# ---- the project's Python modules -------------------------------------------------------------

@dataclass(frozen=True)
class PackageLayout:
    roots: tuple[Path, ...]  # directories that hold the top-level packages (pyproject's `where`)
    top_level: tuple[str, ...]  # the project's top-level package names

    @classmethod
    def from_pyproject(cls, repo: Path = REPO_ROOT) -> "PackageLayout":
        find = tomllib.loads((repo / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
        roots = tuple(repo / w for w in find["where"])
        include = [p for p in find["include"]]
        tops = sorted({d.name for r in roots for d in r.iterdir()
                       if (d / "__init__.py").is_file() and any(fnmatch.fnmatch(d.name, p) for p in include)})
        return cls(roots, tuple(tops))

    def modules(self) -> dict[str, Path]:
        """Dotted module name -> file, for every module of the project's packages."""
        out: dict[str, Path] = {}
        for root in self.roots:
            for top in self.top_level:
                for f in sorted((root / top).rglob("*.py")) if (root / top).is_dir() else []:
                    parts = list(f.relative_to(root).with_suffix("").parts)
                    if parts[-1] == "__init__":
                        parts.pop()
                    out[".".join(parts)] = f
        return out


def _imported(tree: ast.Module, module: str, is_package: bool) -> set[str]:
    """Dotted names a module imports (anywhere in it: top level, functions, TYPE_CHECKING blocks).
    `from a import b` yields both a and a.b (b may be a submodule or a name in a)."""
    package = module if is_package else module.rpartition(".")[0]
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = package.split(".")
                if node.level > 1:
                    base_parts = base_parts[: len(base_parts) - (node.level - 1)]
                base = ".".join(base_parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names if alias.name != "*")
    return names


@dataclass(frozen=True)
class MissingImport:
    importer: str  # the copied module
    missing: str  # the project module it imports that the image lacks
    file: Path  # where the missing module lives in the repository

    def __str__(self) -> str:
        return f"{self.importer} imports {self.missing} ({self.file.relative_to(REPO_ROOT)}), which is not copied"


def missing_imports(dockerfile: Path, repo: Path = REPO_ROOT) -> list[MissingImport]:
    """Project modules that a module the Dockerfile copies imports, but that the Dockerfile does not copy
    (nor their packages' __init__.py)."""
    layout = PackageLayout.from_pyproject(repo)
    modules = layout.modules()
    copied = copied_files(dockerfile, repo)
    present = {name for name, f in modules.items() if f in copied}
    out: list[MissingImport] = []
    for name in sorted(present):
        f = modules[name]
        tree = ast.parse(f.read_text(), filename=str(f))
        needed: set[str] = set()
        for imported in _imported(tree, name, f.name == "__init__.py"):
            if imported.split(".")[0] not in layout.top_level:
                continue
            parts = imported.split(".")
            # The module itself (when it is one: `from a import b` may name an attribute b) and every
            # package above it, whose __init__.py Python runs first.
            needed.update(".".join(parts[:i]) for i in range(1, len(parts) + 1) if ".".join(parts[:i]) in modules)
        out += [MissingImport(name, m, modules[m]) for m in sorted(needed - present)]
    return out

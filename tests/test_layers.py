"""The layout's rules. Kubernetes I/O lives in `finetune_operator/shell/` (and `cli.py`, which starts
it). Every other module of the operator is the pure core and imports neither the Kubernetes client's
I/O parts nor the shell, not even inside a function (a function-local import hides a layer
violation from a reader as well as from a top-level scan). No module at all imports another HTTP
stack than the Kubernetes client's (shell/apiclient.py bounds every request it makes): not kopf, not
aiohttp.

Below both, the trainer (`images/trainer/finetune_trainer/`) imports nothing of the operator: the
operator builds on the trainer's contract, vocabularies and levers, never the other way, so the
trainer needs nothing of the operator to run and the two packages cannot import each other in a cycle."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "operator" / "finetune_operator"
TRAINER = Path(__file__).resolve().parents[1] / "images" / "trainer" / "finetune_trainer"
SHELL_ONLY = ("kubernetes.client", "kubernetes.watch", "kubernetes.config", "kubernetes.dynamic",
              "finetune_operator.shell")
# Another HTTP client (its own connections, its own timeouts or none) or a framework that brings one.
OTHER_HTTP_STACKS = ("kopf", "aiohttp", "httpx", "requests", "kubernetes_asyncio")


def _imports(path: Path, root: Path | None = None) -> list[tuple[int, str]]:
    """Every module name an import statement of `path` (in package `root`, the operator's by default)
    reaches, relative imports resolved."""
    module = ".".join(path.relative_to((root or PACKAGE).parent).with_suffix("").parts)
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            # `from kubernetes import client` reaches kubernetes.client: name each imported name too.
            found += [(node.lineno, base)] + [(node.lineno, f"{base}.{a.name}") for a in node.names]
    return found


def _violations() -> list[str]:
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE)
        if rel.parts[0] == "shell" or rel.as_posix() == "cli.py":
            continue
        for line, name in _imports(path):
            if any(name == s or name.startswith(s + ".") for s in SHELL_ONLY):
                out.append(f"{rel}:{line} imports {name}")
    return out


def test_the_core_imports_no_kubernetes_io_and_no_shell():
    assert _violations() == []


def _other_http_stacks(package: Path) -> list[str]:
    return [f"{path.relative_to(package)}:{line} imports {name}"
            for path in sorted(package.rglob("*.py")) for line, name in _imports(path, package)
            if any(name == s or name.startswith(s + ".") for s in OTHER_HTTP_STACKS)]


def test_the_operator_has_one_http_stack():
    assert _other_http_stacks(PACKAGE) == []


def test_the_http_stack_scan_sees_a_function_local_import(tmp_path):
    fake = tmp_path / "finetune_operator"
    (fake / "shell").mkdir(parents=True)
    (fake / "shell" / "x.py").write_text("def f():\n    import kopf\n    from aiohttp import web\n")
    assert _other_http_stacks(fake) == ["shell/x.py:2 imports kopf", "shell/x.py:3 imports aiohttp",
                                        "shell/x.py:3 imports aiohttp.web"]


def _trainer_violations() -> list[str]:
    return [f"{path.relative_to(TRAINER)}:{line} imports {name}"
            for path in sorted(TRAINER.rglob("*.py")) for line, name in _imports(path, TRAINER)
            if name == "finetune_operator" or name.startswith("finetune_operator.")]


def test_the_trainer_imports_nothing_of_the_operator():
    assert _trainer_violations() == []


def test_the_scan_sees_function_local_and_relative_imports(tmp_path, monkeypatch):
    fake = tmp_path / "finetune_operator"
    (fake / "planning").mkdir(parents=True)
    (fake / "planning" / "x.py").write_text("def f():\n    from ..shell import reconciler\n"
                                            "    from kubernetes import client\n")
    monkeypatch.setattr(__import__(__name__), "PACKAGE", fake)
    assert _violations() == ["planning/x.py:2 imports finetune_operator.shell",
                             "planning/x.py:2 imports finetune_operator.shell.reconciler",
                             "planning/x.py:3 imports kubernetes.client"]


def test_the_trainer_scan_sees_function_local_imports(tmp_path, monkeypatch):
    fake = tmp_path / "finetune_trainer"
    fake.mkdir()
    (fake / "run.py").write_text("def f():\n    import finetune_operator.sizing\n")
    monkeypatch.setattr(__import__(__name__), "TRAINER", fake)
    assert _trainer_violations() == ["run.py:2 imports finetune_operator.sizing"]

"""A training backend is one object, listed once (rendering/backend.py's BACKENDS); nothing outside
the backend modules names a kind, so a new backend is a module, its registration and its policy name."""

from __future__ import annotations

import ast
import typing
from pathlib import Path

from finetune_operator.planning.policy import ClusterPolicy
from finetune_operator.rendering import backend as registry
from finetune_operator.rendering.backend_interface import Backend, ProgressSource, Suspendable

PACKAGE = Path(__file__).resolve().parents[2] / "operator" / "finetune_operator"
# The modules that may name a kind: the interface, the registry, and each backend's own.
BACKEND_MODULES = {"rendering/backend_interface.py", "rendering/backend.py", "rendering/pytorchjob.py",
                   "rendering/trainjob.py", "rendering/renderer.py"}
# Where a backend's name must appear besides: the policy's trainingBackend values (planning cannot
# import rendering, which imports planning).
POLICY = "planning/policy.py"


def test_each_backend_has_the_required_part_and_is_listed_once():
    assert len({b.name for b in registry.BACKENDS}) == len({b.kind for b in registry.BACKENDS}) == len(registry.BACKENDS)
    for backend in registry.BACKENDS:
        assert isinstance(backend, Backend)
        for attribute in ("name", "group", "version", "plural", "kind", "product", "trainer_container"):
            assert isinstance(getattr(backend, attribute), str) and getattr(backend, attribute)
        assert type(backend).render_job is not Backend.render_job and type(backend).state is not Backend.state
        assert registry.backend_of_kind(backend.kind) is backend and registry.backend_named(backend.name) is backend
    assert sorted(b.name for b in registry.AUTO_ORDER) == sorted(b.name for b in registry.BACKENDS)
    assert set(registry.DEFAULT_SERVED) <= set(registry.BACKENDS)


def test_the_policy_offers_exactly_the_registered_backends():
    values = typing.get_args(ClusterPolicy.model_fields["training_backend"].annotation)
    assert set(values) == {registry.AUTO, *(b.name for b in registry.BACKENDS)}


def test_the_capabilities_read_as_the_backends_declare_them():
    for backend in registry.BACKENDS:
        summary = backend.summary({"kind": backend.kind, "metadata": {"name": "x", "managedFields": [1]},
                                   "spec": {"big": "template"}, "status": {}})
        assert summary["metadata"] == {"name": "x"} and "big" not in str(summary)
        if isinstance(backend, Suspendable):
            on = backend.suspend_patch(True)
            assert backend.suspended(on) and not backend.suspended(backend.suspend_patch(False))
        if isinstance(backend, ProgressSource):
            assert not backend.is_rank0({})
    assert registry.trainer_containers() == tuple(dict.fromkeys(b.trainer_container for b in registry.BACKENDS))


def _strings(path: Path) -> list[tuple[int, str]]:
    """The string constants of a module that are not docstrings (docs may name a kind)."""
    tree = ast.parse(path.read_text())
    docs = {id(node.body[0].value) for node in ast.walk(tree)
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    return [(node.lineno, node.value) for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs]


def test_no_code_outside_the_backend_modules_names_a_kind():
    exact = {v for b in registry.BACKENDS for v in (b.kind, b.name, b.plural, b.trainer_container)}
    dotted = {v for b in registry.BACKENDS for v in (b.group, b.api_version, b.resource)}
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        where = path.relative_to(PACKAGE).as_posix()
        if where in BACKEND_MODULES:
            continue
        for line, text in _strings(path):
            if (text in exact and where != POLICY) or any(d in text for d in dotted):
                found.append(f"{where}:{line}: {text!r}")
    assert not found, "a kind named outside the backend modules:\n" + "\n".join(found)

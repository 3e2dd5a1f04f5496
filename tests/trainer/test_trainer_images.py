"""The Dockerfiles' essentials (there is no container engine here to build them)."""

from __future__ import annotations

import ast
import json
import re
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# The Dockerfile reader lives in e2e/lab; `pytest tests/trainer` alone must find it too.
if str(REPO) not in sys.path:
    sys.path.append(str(REPO))
HEAVY = {"torch", "transformers", "peft", "accelerate", "deepspeed", "bitsandbytes", "datasets"}


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments), as the lab's one Dockerfile reader (e2e/lab/dockerfile.py) reads them."""
    from e2e.lab.dockerfile import parse

    return [(i.keyword, i.text) for i in parse(path.read_text())]


@pytest.mark.parametrize("image", ["trainer", "operator"])
def test_pinned_base_non_root_user_and_exec_entrypoint(image):
    steps = instructions(REPO / "images" / image / "Dockerfile")
    bases = [args for kind, args in steps if kind == "FROM"]
    assert bases
    for base in bases:
        name = base.split()[0]
        assert "@sha256:" in name or re.search(r":\d+\.\d+\.\d+", name), f"base {name} is not pinned"
        assert not name.endswith(":latest")
    kinds = [kind for kind, _ in steps]
    users = [args for kind, args in steps if kind == "USER"]
    assert users, "no USER"
    final_user = users[-1].split(":")[0]
    assert final_user not in ("root", "0") and final_user.isdigit(), "run as a numeric non-root UID"
    # Nothing runs as root after the switch.
    assert "RUN" not in kinds[len(kinds) - 1 - kinds[::-1].index("USER"):]
    [entrypoint] = [args for kind, args in steps if kind == "ENTRYPOINT"]
    assert isinstance(json.loads(entrypoint), list), "exec-form ENTRYPOINT, so signals reach the process"


def test_trainer_image_installs_the_trainer_and_runs_the_launcher():
    steps = instructions(REPO / "images" / "trainer" / "Dockerfile")
    runs = " ".join(args for kind, args in steps if kind == "RUN")
    assert '".[trainer]"' in runs and "--no-build-isolation" in runs
    env = " ".join(args for kind, args in steps if kind == "ENV")
    assert "HF_HUB_OFFLINE=1" in env
    [entrypoint] = [json.loads(args) for kind, args in steps if kind == "ENTRYPOINT"]
    assert entrypoint[-2:] == ["-m", "finetune_trainer.launch"]
    assert "cuda" in [a for k, a in steps if k == "FROM"][0]


def test_operator_image_has_no_torch():
    steps = instructions(REPO / "images" / "operator" / "Dockerfile")
    runs = " ".join(args for kind, args in steps if kind == "RUN")
    install = runs.split("pip install", 1)[1].split("&&")[0]
    assert "[" not in install, "no extras in the operator image"
    assert not any(h in install for h in HEAVY)
    # Which trainer files it copies (and that they are all it imports): e2e/test_dockerfiles.py.
    # What `pip install .` pulls in: the base dependencies.
    base = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    names = {re.split(r"[<>=!~\[; ]", d, maxsplit=1)[0].lower() for d in base}
    assert not names & HEAVY, names & HEAVY


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module.split(".")[0])
    return found


def test_operator_code_and_the_contract_import_nothing_heavy():
    operator_files = list((REPO / "operator" / "finetune_operator").rglob("*.py"))
    # The trainer modules the operator imports (pure Python): modules, and the packages of the
    # contract and of the levers' registry.
    shared = ["contract", "combinations", "failures", "rules", "optimizers", "memory_levers"]
    package = REPO / "images" / "trainer" / "finetune_trainer"
    shared_files = []
    for name in shared:
        shared_files += sorted((package / name).glob("*.py")) if (package / name).is_dir() else [package / f"{name}.py"]
    assert all(path.is_file() for path in shared_files), shared_files
    for path in operator_files + shared_files:
        heavy = imported_modules(path) & HEAVY
        assert not heavy, f"{path.relative_to(REPO)} imports {heavy}"
    # The operator reaches into the trainer package only for the contract, the combination rules, the
    # failure vocabulary and the levers' registry.
    allowed = {f"finetune_trainer.{name}" for name in shared}
    for path in operator_files:
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("finetune_trainer"):
                assert node.module in allowed or (
                    node.module == "finetune_trainer" and {a.name for a in node.names} <= set(shared)
                ), f"{path.relative_to(REPO)} imports {node.module}"

"""Fast tests (no docker, no build) of the project's Dockerfiles as the lab reads them (e2e/lab/dockerfile.py).

The main one: every project module a Dockerfile copies must find the project modules it imports in the
image too. The operator image once copied finetune_trainer/contract.py without combinations.py, which it
imports, and the Dockerfile's own import check failed with `No module named 'finetune_trainer.combinations'`.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from e2e.lab import images
from e2e.lab.dockerfile import (
    DOCKERFILES,
    REPO_ROOT,
    Copy,
    DockerfileError,
    Instruction,
    copied_files,
    copies,
    missing_imports,
    parse,
    source_files,
)


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.parent.name)
def test_dockerfile_copies_every_project_module_its_code_imports(dockerfile: Path):
    missing = missing_imports(dockerfile)
    assert not missing, f"{dockerfile.relative_to(REPO_ROOT)}:\n" + "\n".join(map(str, missing))


def test_the_check_names_what_a_dockerfile_lacks(tmp_path: Path):
    # The operator image as it was: the contract without the combinations it imports.
    dockerfile = tmp_path / "Dockerfile"
    dockerfile.write_text(
        "FROM debian:bookworm\n"
        "COPY images/trainer/finetune_trainer/__init__.py ./images/trainer/finetune_trainer/\n"
        "COPY images/trainer/finetune_trainer/contract ./images/trainer/finetune_trainer/contract\n"
    )
    missing = missing_imports(dockerfile)
    assert ("finetune_trainer.contract.config", "finetune_trainer.combinations") in [(m.importer, m.missing) for m in missing]
    assert any("combinations.py" in str(m) for m in missing)


def test_a_missing_package_init_counts(tmp_path: Path):
    # Python runs finetune_trainer/__init__.py before combinations.py: leaving it out is a missing import too.
    dockerfile = tmp_path / "Dockerfile"
    dockerfile.write_text(
        "FROM debian:bookworm\n"
        "COPY images/trainer/finetune_trainer/combinations.py \\\n"
        "     images/trainer/finetune_trainer/failures.py ./t/\n"
    )
    assert "finetune_trainer" in {m.missing for m in missing_imports(dockerfile)}


def test_the_operator_image_leaves_the_training_code_out():
    # The point of its partial COPY: no torch-importing trainer modules in the operator image.
    files = {f.relative_to(REPO_ROOT).as_posix() for f in copied_files(DOCKERFILES[0])}
    trainer = {f for f in files if f.startswith("images/trainer/")}
    levers = {f.relative_to(REPO_ROOT).as_posix()
              for f in (REPO_ROOT / "images/trainer/finetune_trainer/memory_levers").glob("*.py")}
    contract = {f.relative_to(REPO_ROOT).as_posix()
                for f in (REPO_ROOT / "images/trainer/finetune_trainer/contract").glob("*.py")}
    assert trainer == {f"images/trainer/finetune_trainer/{m}.py"
                       for m in ("__init__", "combinations", "failures", "rules", "optimizers")} | levers | contract
    assert not any("__pycache__" in f for f in files), ".dockerignore keeps build outputs out"


def test_parse_joins_continuations_and_skips_comments():
    ins = parse(
        "# a comment\n"
        "FROM python:3.11\n"
        "ENV A=1 \\\n"
        "    # a comment inside\n"
        "    B=2\n"
        'ENTRYPOINT ["finetune-operator"]\n'
    )
    assert [(i.keyword, i.text, i.line) for i in ins] == [
        ("FROM", "python:3.11", 2), ("ENV", "A=1 B=2", 3), ("ENTRYPOINT", '["finetune-operator"]', 6)]
    assert ins[2].exec_form() == ["finetune-operator"]
    assert ins[1].exec_form() is None


@pytest.mark.parametrize("text, message", [
    ("FROM a\nARG X=1\n", "ARG is not supported"),
    ("FROM a\nFROM b\n", "exactly one FROM"),
    ("RUN true\n", "exactly one FROM"),
    ("FROM a\nRUN true \\\n", "ends inside a continued line"),
    ('FROM a\nCMD ["x", 1]\n', "list of strings"),
])
def test_parse_refuses_what_the_lab_cannot_follow(text: str, message: str):
    with pytest.raises(DockerfileError, match=message):
        for ins in parse(text):
            ins.exec_form()


@pytest.mark.parametrize("line, message", [
    ("COPY --from=build /x /y", "--from=build is not supported"),
    ("COPY operator/*.py /x/", "only plain paths"),
    ("COPY ../secret /x", "only plain paths"),
    ("COPY onlyone", "at least one source and a destination"),
])
def test_copy_refuses_what_the_lab_cannot_follow(line: str, message: str):
    with pytest.raises(DockerfileError, match=message):
        copies(parse(f"FROM a\n{line}\n"))


def test_source_files_place_files_as_docker_does():
    one = Copy(("pyproject.toml",), "./pyproject.toml", 1)
    assert source_files(one) == [(REPO_ROOT / "pyproject.toml", "")]
    several = Copy(("pyproject.toml", "README.md"), "./", 1)
    assert [rel for _, rel in source_files(several)] == ["pyproject.toml", "README.md"]
    tree = Copy(("images/trainer",), "/x", 1)
    rels = [rel for _, rel in source_files(tree)]
    assert "finetune_trainer/contract/config.py" in rels and "Dockerfile" in rels
    with pytest.raises(DockerfileError, match="does not exist"):
        source_files(Copy(("no/such/file",), "/x", 3))


# ---- the image builder's pure parts -------------------------------------------------------------------

def test_images_are_named_as_the_chart_and_the_renderer_name_them():
    from finetune_operator.planning.policy import DEFAULT_TRAINER_IMAGE

    names = images.image_names()
    assert names["operator"] == ("ghcr.io/finetune-operator/operator:0.1.0",)
    assert names["trainer"] == ("registry.eu-de-berlin.internal/finetune-operator/trainer:0.1.0", DEFAULT_TRAINER_IMAGE)


def test_each_dockerfile_from_has_a_lab_base():
    for spec in images.specs():
        from e2e.lab.dockerfile import parse

        assert images.base_for(parse(spec.dockerfile.read_text())[0].text).packages
    with pytest.raises(images.ImageBuildError, match="no base for `FROM alpine:3`"):
        images.base_for("alpine:3")


def test_the_trainer_base_says_it_uses_the_host_python():
    base = images.base_for("pytorch/pytorch:2.15.0-cuda13.2-cudnn9-devel")
    assert base.host_python and "read-only" in base.why
    assert images.base_for("python:3.11.7-slim-bookworm").host_python is False


def test_a_lab_run_from_a_virtual_environment_gives_the_trainer_image_that_environment(monkeypatch):
    # Outside a virtual environment: the installation only.
    monkeypatch.setattr(images.sys, "prefix", images.sys.base_prefix)
    assert images.host_python_paths() == (Path(images.sys.base_prefix),)
    assert images.host_venv_site_packages() == ()
    # In one (where pip put torch & co.): the environment too, mounted and named by /opt/venv's .pth.
    monkeypatch.setattr(images.sys, "prefix", "/var/ci/venv")
    monkeypatch.setattr(images.sysconfig, "get_paths", lambda: {"purelib": "/var/ci/venv/lib/python3.11/site-packages",
                                                                "platlib": "/var/ci/venv/lib/python3.11/site-packages"})
    assert images.host_python_paths() == (Path(images.sys.base_prefix), Path("/var/ci/venv"))
    assert images.host_venv_site_packages() == ("/var/ci/venv/lib/python3.11/site-packages",)
    assert "mkdir -p /var/ci/venv" in images.base_for("pytorch/pytorch:2.15.0-cuda13.2-cudnn9-devel").setup
    # One below a path the pods mount a volume at (the scratch emptyDir at /tmp) would be hidden there.
    monkeypatch.setattr(images.sys, "prefix", "/tmp/ci/venv")
    with pytest.raises(images.ImageBuildError, match="below /tmp"):
        images.host_python_paths()


@pytest.mark.parametrize("text, words", [
    ("A=1 B='two words'", {"A": "1", "B": "two words"}),
])
def test_env_instructions(text: str, words: dict):
    assert images.parse_env(Instruction("ENV", text, 3)) == words


@pytest.mark.parametrize("keyword, text, fn", [
    ("ENV", "A 1", images.parse_env),
    ("USER", "trainer", images.parse_user),
    ("USER", "1000:x", images.parse_user),
])
def test_instructions_the_builder_cannot_follow_are_refused(keyword: str, text: str, fn):
    with pytest.raises(images.ImageBuildError, match="line 7"):
        fn(Instruction(keyword, text, 7))


def test_user_defaults_its_group_to_the_uid():
    assert images.parse_user(Instruction("USER", "65532", 1)) == "65532:65532"


def test_the_image_key_follows_the_dockerfile_and_the_copied_files(tmp_path: Path, monkeypatch):
    dockerfile = tmp_path / "Dockerfile"
    dockerfile.write_text("FROM python:3.11.7-slim-bookworm\nCOPY pyproject.toml ./\n")
    spec = images.ImageSpec("operator", dockerfile, ("x:1",))
    key = images.image_key(spec)
    assert images.image_key(spec) == key
    dockerfile.write_text("FROM python:3.11.7-slim-bookworm\nCOPY pyproject.toml ./\nUSER 1\n")
    assert images.image_key(spec) != key
    dockerfile.write_text("FROM python:3.11.7-slim-bookworm\nCOPY pyproject.toml ./\n")
    # A copied file's bytes are part of the key (read through the builder's own reader).
    real = Path.read_bytes
    monkeypatch.setattr(Path, "read_bytes", lambda p: real(p) + b"#" if p.name == "pyproject.toml" else real(p))
    assert images.image_key(spec) != key

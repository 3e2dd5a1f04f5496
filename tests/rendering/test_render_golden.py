"""Golden files: what `finetune-operator render` prints for the examples against examples/pools.yaml.

A change to the plan search or the renderer shows up here as a diff to review. After an
intended change, regenerate with `UPDATE_GOLDEN=1 pytest tests/rendering/test_render_golden.py`
and commit the files with the change.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml
from manifest_checks import attempt_errors

from finetune_operator import api
from finetune_operator.cli import main
from finetune_operator.planning import Plan, plan_job
from finetune_operator.planning.report import planning_inputs
from finetune_operator.rendering import render_attempt
from finetune_operator.rendering.output import manifests_yaml
from repo_files import EXAMPLES, example_jobs

GOLDEN = Path(__file__).parent / "golden"
POOLS = EXAMPLES / "pools.yaml"
UPDATE = os.environ.get("UPDATE_GOLDEN") == "1"


def render_example(path: Path, attempt: int = 1) -> tuple[str, list[dict]]:
    job = api.parse_job(yaml.safe_load(path.read_text()))
    pools, policy = planning_inputs(str(POOLS), POOLS.read_text(), None, None)
    plan = plan_job(job.spec, pools, policy)
    assert isinstance(plan, Plan), plan
    rendered = render_attempt(job, plan, attempt, policy)
    return manifests_yaml(rendered.objects), rendered.objects


@pytest.mark.parametrize("example", example_jobs(), ids=lambda p: p.stem)
def test_example_matches_its_golden_file(example):
    text, objects = render_example(example)
    golden = GOLDEN / f"{example.stem}.yaml"
    if UPDATE:
        golden.write_text(text)
    assert golden.exists(), f"{golden} is missing; run with UPDATE_GOLDEN=1 to create it"
    assert text == golden.read_text(), f"{example.name} renders differently from {golden.name} (UPDATE_GOLDEN=1 after review)"
    config_map, pytorch_job = objects
    assert attempt_errors(config_map, pytorch_job) == []


def test_there_is_a_golden_file_per_example_and_no_other():
    assert sorted(p.stem for p in GOLDEN.glob("*.yaml")) == sorted(p.stem for p in example_jobs())


@pytest.mark.parametrize("example", example_jobs(), ids=lambda p: p.stem)
def test_cli_prints_the_golden_yaml(example, capsys):
    assert main(["render", str(example), "--pools", str(POOLS)]) == 0
    out = capsys.readouterr().out
    assert out == (GOLDEN / f"{example.stem}.yaml").read_text()
    kinds = [d["kind"] for d in yaml.safe_load_all(out)]
    assert kinds == ["ConfigMap", "PyTorchJob"]


def test_cli_attempt_names_the_objects(capsys):
    example = example_jobs()[0]
    assert main(["render", str(example), "--pools", str(POOLS), "--attempt", "3"]) == 0
    names = {d["metadata"]["name"] for d in yaml.safe_load_all(capsys.readouterr().out)}
    job_name = yaml.safe_load(example.read_text())["metadata"]["name"]
    assert names == {f"{job_name}-a3"}


def test_cli_errors_name_the_problem(tmp_path, capsys):
    example = example_jobs()[0]
    assert main(["render", str(example), "--pools", str(POOLS), "--attempt", "0"]) == 2
    assert "--attempt: must be at least 1" in capsys.readouterr().err
    policy = tmp_path / "policy.yaml"
    policy.write_text("allowedRegions: [us-east-virginia]\n")
    assert main(["render", str(example), "--pools", str(POOLS), "--policy", str(policy)]) == 2
    assert "no plan fits" in capsys.readouterr().err

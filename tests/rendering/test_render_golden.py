"""Golden files: the manifests of the examples, planned against examples/pools.yaml.

Each example has two files: `<example>.plan.json`, the plan `plan_job` gave for it against
examples/pools.yaml (the input), and `<example>.yaml`, what rendering that plan prints (the
output). Rendering is checked against the stored plan, so a change to the sizing model or
the plan search (which their own tests cover) does not show up as a rendering diff; the
CLI test checks that `finetune-operator render` prints what the current plan renders to.
After an intended change, regenerate both with
`UPDATE_GOLDEN=1 pytest tests/rendering/test_render_golden.py`, review the diff, commit.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml
from manifest_checks import attempt_errors

from finetune_operator import api
from finetune_operator.cli import main
from finetune_operator.planning import ClusterPolicy, Plan, plan_job
from finetune_operator.planning.report import planning_inputs
from finetune_operator.rendering import render_attempt
from finetune_operator.rendering.output import manifests_yaml
from repo_files import EXAMPLES, example_jobs

GOLDEN = Path(__file__).parent / "golden"
POOLS = EXAMPLES / "pools.yaml"
UPDATE = os.environ.get("UPDATE_GOLDEN") == "1"


def load_example(path: Path) -> api.FineTuneJob:
    return api.parse_job(yaml.safe_load(path.read_text()))


def example_policy() -> ClusterPolicy:
    """What the CLI uses without --policy: the pools file's allowedRegions and the default image."""
    return planning_inputs(str(POOLS), POOLS.read_text(), None, None)[1]


def current_plan(job: api.FineTuneJob) -> tuple[Plan, ClusterPolicy]:
    pools, policy = planning_inputs(str(POOLS), POOLS.read_text(), None, None)
    plan = plan_job(job.spec, pools, policy)
    assert isinstance(plan, Plan), plan
    return plan, policy


def stored_plan(example: Path) -> Plan:
    return Plan.model_validate(json.loads((GOLDEN / f"{example.stem}.plan.json").read_text()))


@pytest.mark.parametrize("example", example_jobs(), ids=lambda p: p.stem)
def test_example_matches_its_golden_file(example):
    job = load_example(example)
    policy = example_policy()
    if UPDATE:
        plan, _ = current_plan(job)
        (GOLDEN / f"{example.stem}.plan.json").write_text(
            json.dumps(plan.model_dump(mode="json", exclude={"gpus"}), indent=2, sort_keys=True) + "\n"
        )
        (GOLDEN / f"{example.stem}.yaml").write_text(manifests_yaml(render_attempt(job, plan, 1, policy).objects))
    rendered = render_attempt(job, stored_plan(example), 1, policy)
    text = manifests_yaml(rendered.objects)
    golden = GOLDEN / f"{example.stem}.yaml"
    assert text == golden.read_text(), f"{example.name} renders differently from {golden.name} (UPDATE_GOLDEN=1 after review)"
    assert attempt_errors(rendered.config_map, rendered.pytorch_job) == []


def test_there_are_golden_files_per_example_and_no_other():
    stems = sorted(p.stem for p in example_jobs())
    assert sorted(p.stem for p in GOLDEN.glob("*.yaml")) == stems
    assert sorted(p.name.removesuffix(".plan.json") for p in GOLDEN.glob("*.plan.json")) == stems


@pytest.mark.parametrize("example", example_jobs(), ids=lambda p: p.stem)
def test_cli_prints_what_the_current_plan_renders_to(example, capsys):
    assert main(["render", str(example), "--pools", str(POOLS)]) == 0
    out = capsys.readouterr().out
    job = load_example(example)
    plan, policy = current_plan(job)
    rendered = render_attempt(job, plan, 1, policy)
    assert out == manifests_yaml(rendered.objects)
    documents = list(yaml.safe_load_all(out))
    assert [d["kind"] for d in documents] == ["ConfigMap", "NetworkPolicy", "PyTorchJob"]
    assert attempt_errors(documents[0], documents[-1]) == []


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

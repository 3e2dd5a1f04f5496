"""`finetune-operator plan`: the examples plan against examples/pools.yaml with the real memory model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from finetune_operator import api
from finetune_operator.cli import main

from .nodes import gpu_node, gpu_pod

ROOT = Path(__file__).resolve().parents[2]
POOLS = str(ROOT / "examples" / "pools.yaml")
EXAMPLES = sorted(p for p in (ROOT / "examples").glob("*.yaml") if p.name != "pools.yaml"
                  and yaml.safe_load(p.read_text()).get("kind") == "FineTuneJob")

REQUIRED_KEYS = {"nodePool", "region", "gpuType", "nodes", "gpusPerNode", "strategy", "microBatchSize",
                 "gradientAccumulation", "gradientCheckpointing", "offload", "estimate"}


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_there_are_three_examples():
    assert len(EXAMPLES) >= 3


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.stem)
def test_every_example_plans_inside_its_regions(capsys, example):
    job = api.parse_job(yaml.safe_load(example.read_text()))
    code, out, _ = run(capsys, "plan", str(example), "--pools", POOLS, "-o", "json")
    assert code == 0, out
    plan = json.loads(out)
    assert plan["feasible"] is True
    assert REQUIRED_KEYS <= set(plan)
    assert plan["region"] in job.spec.placement.regions
    assert plan["region"] in {"eu-de-berlin", "eu-fr-paris"}  # the pools file's default policy
    assert set(plan["allowedRegions"]) <= set(job.spec.placement.regions)
    if job.spec.resources.gpu_types:
        assert plan["gpuType"] in job.spec.resources.gpu_types
    assert plan["microBatchSize"] * plan["gradientAccumulation"] * plan["nodes"] * plan["gpusPerNode"] == \
        job.spec.training.global_batch_size
    assert plan["nodes"] * plan["gpusPerNode"] <= job.spec.resources.max_gpus
    assert plan["requiredBytes"] <= plan["gpuMemoryBytes"] * (1 - plan["memoryHeadroom"])
    assert plan["estimate"]["perGPU"]["requiredBytes"] == plan["requiredBytes"]
    assert plan["reason"] and plan["runnersUp"]


def test_table_output_has_breakdown_reason_and_runners_up(capsys):
    code, out, _ = run(capsys, "plan", str(ROOT / "examples" / "llama-8b-full.yaml"), "--pools", POOLS)
    assert code == 0
    assert "Plan for legal-8b-full" in out
    assert "Memory per GPU" in out and "optimizer" in out
    assert "Runners-up:" in out and "Why:" in out
    assert "eu-fr-paris" in out


def test_infeasible_job_exits_1_with_the_nearest_miss(capsys, tmp_path):
    document = yaml.safe_load((ROOT / "examples" / "llama-8b-full.yaml").read_text())
    document["spec"]["resources"] = {"maxGPUs": 1, "gpuTypes": ["H100-80GB"], "strategy": "fsdp", "offload": "none"}
    # With fp32 master weights (bf16 weights would let the 8B fit one H100).
    document["spec"]["training"]["masterWeights"] = "fp32"
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(document))
    code, out, _ = run(capsys, "plan", str(path), "--pools", POOLS, "-o", "json")
    assert code == 1
    answer = json.loads(out)
    assert answer["feasible"] is False
    assert "per GPU on 1 GPU" in answer["message"] and "would fit but maxGPUs is 1" in answer["message"]
    code, out, _ = run(capsys, "plan", str(path), "--pools", POOLS)
    assert code == 1 and "INFEASIBLE" in out


def test_bad_pools_file_names_pool_and_field(capsys, tmp_path):
    bad = tmp_path / "pools.yaml"
    bad.write_text("pools:\n- {name: x1, region: r, gpuType: B300, gpusPerNode: 8, maxNodes: 1}\n")
    code, _, err = run(capsys, "plan", str(ROOT / "examples" / "llama-8b-lora.yaml"), "--pools", str(bad))
    assert code == 2
    assert "pool 'x1' (pools[0]): gpuType: unknown GPU type 'B300'" in err


def test_policy_file_decides_the_regions(capsys, tmp_path):
    policy = tmp_path / "policy.yaml"
    policy.write_text("allowedRegions: [eu-fr-paris]\n")
    code, out, _ = run(capsys, "plan", str(ROOT / "examples" / "llama-8b-lora.yaml"), "--pools", POOLS,
                       "--policy", str(policy), "-o", "json")
    assert code == 1 and "no region in common" in json.loads(out)["message"]


def test_discovered_free_gpus_show_in_the_plan(capsys, tmp_path):
    nodes = {"apiVersion": "v1", "kind": "List", "items": [gpu_node("h1"), gpu_node("h2")]}
    pods = {"apiVersion": "v1", "kind": "List", "items": [gpu_pod("busy", "h1", 8)]}
    (tmp_path / "nodes.json").write_text(json.dumps(nodes))
    (tmp_path / "pods.json").write_text(json.dumps(pods))
    code, out, _ = run(capsys, "plan", str(ROOT / "examples" / "llama-8b-lora.yaml"), "--pools", POOLS,
                       "--nodes", str(tmp_path / "nodes.json"), "--pods", str(tmp_path / "pods.json"), "-o", "json")
    assert code == 0
    plan = json.loads(out)
    assert plan["nodePool"] == "h100-berlin" and plan["freeNow"] is True and plan["needsScaleUp"] is False
    assert "8 GPUs free now" in plan["reason"]

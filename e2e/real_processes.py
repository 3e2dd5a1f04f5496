"""The real trainer behind the lab's pods: the pieces the real-node scenarios and the demo share.

* the chart values that let the operator plan on a lab pool outside the default policy
  (policy.allowedRegions + the pool in the catalog);
* a tiny Llama-style model built from a config and a tiny word-level tokenizer (those the trainer
  tests use, tests/trainer/trainer_assets.py), written into the model claim's directory, and a
  small chat dataset into the data claim's;
* a FineTuneJob for them;
* the trainer's own output: its JSON log lines (start, progress, checkpoint, resume, summary,
  failure) parsed from a log, and the checkpoints in the claim.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path
from typing import Any

import yaml

from e2e.lab.nodes import load_pools, node_taints

REPO_ROOT = Path(__file__).resolve().parents[1]
VOLUME_ROOT = Path("/tmp/lab-volumes")  # where operator_harness.volumes() puts each claim's hostPath PV
# Architecture numbers of the tiny model (trainer_assets.build_model with hidden 64, 2 layers).
TINY = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256}


def _trainer_assets():
    path = REPO_ROOT / "tests" / "trainer" / "trainer_assets.py"
    spec = importlib.util.spec_from_file_location("trainer_assets", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def catalog_entry(pool_name: str) -> dict[str, Any]:
    """The policy catalog's entry for a lab pool (what the operator plans with), its taints the nodes'."""
    pool = load_pools().pool(pool_name)
    return {
        "name": pool.name, "region": pool.region, "zones": list(pool.zones), "gpuType": "H100-80GB",
        "gpusPerNode": pool.gpu.count, "maxNodes": pool.nodes, "pricePerGpuHour": 0.1,
        "hostMemory": pool.memory, "cpus": int(pool.cpu),
        "selector": {"karpenter.sh/nodepool": pool.name},
        "taints": node_taints(pool),
    }


def chart_args(*pools: str) -> list[str]:
    """helm arguments: the default policy's regions and catalog plus the given lab pools and their regions."""
    values = yaml.safe_load((REPO_ROOT / "charts" / "finetune-operator" / "values.yaml").read_text())
    policy = values["policy"]
    regions = list(policy["allowedRegions"]) + sorted({load_pools().pool(p).region for p in pools})
    catalog = list(policy["catalog"]) + [catalog_entry(p) for p in pools]
    return ["--set-json", f"policy.allowedRegions={json.dumps(regions)}",
            "--set-json", f"policy.catalog={json.dumps(catalog)}"]


def claim_dir(namespace: str, claim: str) -> Path:
    return VOLUME_ROOT / f"{namespace}-{claim}"


def write_assets(namespace: str, examples: int = 64) -> int:
    """The tiny model (weights + tokenizer) into the `models` claim, the chat data into `data`;
    returns the vocabulary size (the job's architecture needs it)."""
    assets = _trainer_assets()
    model_dir = claim_dir(namespace, "models") / "tiny-llama"
    model_dir.mkdir(parents=True, exist_ok=True)
    tok = assets.build_tokenizer(model_dir)
    assets.build_model(model_dir, vocab_size=len(tok), hidden=TINY["hidden_size"], layers=TINY["num_hidden_layers"])
    data = claim_dir(namespace, "data")
    data.mkdir(parents=True, exist_ok=True)
    assets.write_jsonl(data / "chat.jsonl", assets.chat_lines(examples))
    return len(tok)


def remove_claims(namespace: str) -> None:
    for claim in ("models", "data", "checkpoints"):
        shutil.rmtree(claim_dir(namespace, claim), ignore_errors=True)


# The lab GPU's true peak over the estimate that makes a tiny job sized as Llama 3.1 8B at 4096 tokens
# (LoRA, dropout 0: 42.6 GiB predicted on an H100) run out of GPU memory: 2 x that exceeds the
# H100's 79.6 GiB, and the re-plan the operator calibrates from the report fits. (At the API's default
# dropout 0.05 the prediction is 47.3 GiB, and 1.7 was enough.)
OOM_FACTOR = "2.0"


# A family the analytic model does not size (Falcon: fused query_key_value, parallel attention,
# LayerNorm, a GELU MLP; GPT-NeoX was the example until issue 28 made it analytic); one block, so
# the pre-flight profile traces it in seconds.
TINY_FALCON = {"model_type": "falcon", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 256,
               "num_hidden_layers": 1, "num_attention_heads": 4, "max_position_embeddings": 2048,
               "architectures": ["FalconForCausalLM"], "torch_dtype": "bfloat16", "bos_token_id": 0, "eos_token_id": 0}


def tiny_job(name: str, namespace: str, vocab_size: int, *, region: str, gpus: int = 1, max_steps: int = 24,
             every_steps: int = 4, global_batch: int = 4, learning_rate: float = 0.02,
             rule: dict[str, str] | None = None, attempts: int = 4, sized_as: str | None = None,
             sequence_length: int = 64, evaluation: dict[str, Any] | None = None,
             export: str | None = None) -> dict[str, Any]:
    """A LoRA job on the tiny model. `sized_as` (a preset, e.g. llama-3.1-8b): the operator plans
    (sizes) the job as that model, while the trainer trains the tiny model the claim holds; the
    lab GPU's out-of-memory rule then has a realistic predicted peak to judge (a tiny model's plan
    fits any GPU, and no lever could make it fit better after an OOM)."""
    architecture = {"preset": sized_as} if sized_as else {"inline": {**TINY, "vocab_size": vocab_size}}
    return {
        "apiVersion": "finetune.dev/v1alpha1",
        "kind": "FineTuneJob",
        "metadata": {"name": name, "namespace": namespace,
                     "annotations": {f"lab.finetune.dev/{k}": v for k, v in (rule or {}).items()}},
        "spec": {
            "model": {"name": "lab/tiny-llama",
                      "architecture": architecture,
                      "source": {"pvc": {"claimName": "models", "path": "tiny-llama"}}},
            "dataset": {"source": {"pvc": {"claimName": "data", "path": "chat.jsonl"}}, "format": "chat"},
            "method": "lora",
            "lora": {"rank": 4, "alpha": 8, "dropout": 0.0, "targetModules": ["all-linear"]},
            "training": {"sequenceLength": sequence_length, "globalBatchSize": global_batch, "maxSteps": max_steps,
                         "learningRate": learning_rate},
            "resources": {"gpus": gpus, "maxGPUs": 2},
            "placement": {"regions": [region]},
            "recovery": {"maxAttempts": attempts, "backoff": {"initialSeconds": 1, "maxSeconds": 2}},
            "checkpoint": {"pvc": {"claimName": "checkpoints", "path": name}, "everySteps": every_steps},
            **({"evaluation": evaluation} if evaluation else {}),
            **({"export": export} if export else {}),
        },
    }


# ---- the trainer's own output -----------------------------------------------------------------------
def events(lines: list[str], kind: str | None = None) -> list[dict[str, Any]]:
    out = []
    for line in lines:
        if not line.startswith("{"):
            continue
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and (kind is None or record.get("event") == kind):
            out.append(record)
    return out


def losses(progress: list[dict[str, Any]]) -> dict[int, float]:
    return {int(e["step"]): float(e["loss"]) for e in progress if e.get("loss") is not None}


def checkpoint_steps(namespace: str, job: str) -> list[int]:
    root = claim_dir(namespace, "checkpoints") / job
    steps = []
    for meta in root.glob("step-*/meta.json"):
        try:
            steps.append(int(json.loads(meta.read_text())["step"]))
        except (OSError, ValueError, KeyError):
            continue
    return sorted(steps)


def merged_logits_match(base: Path, adapter: Path, merged: Path) -> None:
    """export: merged. The merged folder loads with transformers as is and gives the logits of the base
    model with the adapter (peft) on the same input, within what the saved dtype rounds."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    config = json.loads((merged / "config.json").read_text())
    saved_dtype = config.get("torch_dtype") or config.get("dtype")
    merged_model = AutoModelForCausalLM.from_pretrained(merged, torch_dtype=torch.float32).eval()
    reference = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, torch_dtype=torch.float32),
                                          adapter).eval()
    tokens = torch.arange(1, 33).remainder(merged_model.config.vocab_size).unsqueeze(0)
    with torch.no_grad():
        got, want = merged_model(tokens).logits, reference(tokens).logits
    # Saved in the training dtype: bf16 rounds each merged weight (about 3 significant digits).
    tolerance = 1e-4 if saved_dtype in (None, "float32") else 3e-2 * float(want.abs().max())
    assert float((got - want).abs().max()) <= tolerance, (saved_dtype, float((got - want).abs().max()), tolerance)

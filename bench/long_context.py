"""Long contexts and training.sequenceParallel: what a GPU needs by degree, and what the planner picks.

    python bench/long_context.py

Two tables. The first is the memory model's required bytes per GPU (the plan's `required`: the peak
with the allocator's margin) of a LoRA job (rank 16, all linear layers) under ZeRO-3 on 8 GPUs with
flash attention, gradient checkpointing and the chunked loss (8 chunks), micro-batch 1, by sequence
length and sequence-parallel degree. The second is the planner's plan for the same job left `auto`
(globalBatchSize 8) on a pool of up to 4 nodes of 8 H100-80GB: GPUs, strategy, degree, micro-batch,
required GiB and seconds per step, or why nothing fits. Estimates only: the split's memory term is
checked on the CPU by bench/sequence_parallel_truth.py; nothing here has run on a GPU.
"""

from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "operator"))
sys.path.insert(0, os.path.join(HERE, "..", "images", "trainer"))

from finetune_operator import api  # noqa: E402
from finetune_operator.planning import Infeasible, plan_job  # noqa: E402
from finetune_operator.planning.catalog import load_catalog  # noqa: E402
from finetune_operator.planning.policy import ClusterPolicy  # noqa: E402
from finetune_operator.sizing import SizingError, TrainingSetup, estimate_memory  # noqa: E402
from finetune_operator.sizing.presets import preset  # noqa: E402

PRESETS = ("llama-3.1-8b", "qwen2.5-7b", "llama-3.1-70b")
LENGTHS = (32768, 65536, 131072, 262144)
DEGREES = (1, 2, 4, 8)
GIB = 1 << 30


def required(name: str, length: int, degree: int) -> str:
    try:
        setup = TrainingSetup(architecture=preset(name), method="lora", lora_rank=16, strategy="zero3", world_size=8,
                              micro_batch_size=1, sequence_length=length, gradient_checkpointing=True,
                              attention="flash", loss_chunks=8, sequence_parallel=degree)
        return f"{estimate_memory(setup).required_bytes / GIB:.1f}"
    except SizingError as error:
        return "refused"  # a degree the model's heads do not take (the sizing says why, naming the field)


def planned(name: str, length: int) -> str:
    spec = api.parse_spec({
        "model": {"name": name, "source": {"pvc": {"claimName": "models", "path": name}},
                  "architecture": {"preset": name}},
        "dataset": {"source": {"pvc": {"claimName": "data", "path": "long.jsonl"}}},
        "method": "lora", "lora": {"rank": 16, "targetModules": ["all-linear"]},
        "training": {"sequenceLength": length, "globalBatchSize": 8, "attention": "flash", "maxSteps": 100},
        "resources": {"maxGPUs": 32},
        "placement": {"regions": ["eu-de-berlin"]},
    })
    pools = load_catalog([{"name": "h100", "region": "eu-de-berlin", "gpuType": "H100-80GB", "gpusPerNode": 8,
                           "maxNodes": 4, "pricePerGpuHour": 3.0, "interNodeGbps": 400}])
    plan = plan_job(spec, pools, ClusterPolicy(allowed_regions=["eu-de-berlin"]))
    if isinstance(plan, Infeasible):
        return "infeasible: " + plan.message[:90]
    return (f"{plan.gpus:>2} GPUs {plan.strategy:<5} split {plan.sequence_parallel} micro {plan.micro_batch_size}"
            f" ckpt {'on' if plan.gradient_checkpointing else 'off'} {plan.required_bytes / GIB:5.1f} GiB"
            f" {plan.seconds_per_step:7.1f} s/step")


def main() -> None:
    print("required GiB per GPU: LoRA r16, zero3 on 8 GPUs, flash, checkpointing, 8 loss chunks, micro-batch 1")
    print(f"{'model':<15} {'tokens':>7} " + " ".join(f"{'split ' + str(d):>9}" for d in DEGREES))
    for name in PRESETS:
        for length in LENGTHS:
            print(f"{name:<15} {length:>7} " + " ".join(f"{required(name, length, d):>9}" for d in DEGREES))
    print()
    print("the planner, job left auto (globalBatchSize 8), pool of 4 x 8 H100-80GB")
    for name in PRESETS:
        for length in LENGTHS:
            print(f"{name:<15} {length:>7}  {planned(name, length)}")


if __name__ == "__main__":
    main()

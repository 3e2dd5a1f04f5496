"""The merge's host memory, measured against its estimate (sizing/export.py).

    PYTHONPATH=operator:images/trainer python3 bench/export_memory.py [--vocab 128256 --hidden 1024 ...]

Builds a random Llama-shaped base (bf16 safetensors, two shards, written tensor by tensor) and a
random LoRA adapter on every linear layer of its blocks (the files peft writes: adapter_config.json
and adapter_model.safetensors), then runs the trainer's export (finetune_trainer.export) in a fresh
process per case and reads that process's peak resident set (``VmHWM`` in /proc/self/status at its
end: the high-water mark of its own address space, which, unlike ``ru_maxrss``, does not carry
the parent's size over fork and exec). A second fresh process does everything but the merge (imports, the meta-device
skeleton, the plan): its peak is the runtime, and the difference is what the merge itself held.
The estimate's working set is compared with that difference; its runtime constant
(HOST_PROCESS_BYTES, a training process's) with the measured runtime of this bare process.
No GPU, no download.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

MiB = 1 << 20

CHILD = r"""
import json, sys, torch
from finetune_trainer import export
args = json.loads(sys.argv[1])


def high_water():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024



if args["merge"]:
    result = export.export_folder(kind=args["kind"], output=args["output"], base=args["base"],
                                  tokenizer=args["base"], dtype=getattr(torch, args["dtype"]))
    print(json.dumps({"sampledPeakRss": result.peak_rss_bytes, "shards": result.shards,
                      "totalBytes": result.total_bytes, "seconds": result.seconds, "peak": high_water()}))
else:  # the same process without the merge: imports, skeleton, plan
    weights = export.WeightsFolder(args["base"] if args["kind"] == "merged" else args["output"], "bench")
    adapter = export.Adapter(args["output"]) if args["kind"] == "merged" else None
    skeleton = export._model_skeleton(export.Path(args["base"]), False)
    export.plan_export(weights, adapter, export.tied_groups(skeleton), getattr(torch, args["dtype"]),
                       export.MAX_SHARD_BYTES)
    print(json.dumps({"peak": high_water()}))
"""


def build(root: Path, vocab: int, hidden: int, intermediate: int, layers: int, rank: int, seed: int = 0) -> dict:
    import torch
    from transformers import LlamaConfig

    from finetune_trainer.safetensors_io import TensorInfo, write_file

    base = root / "base"
    base.mkdir()
    heads = max(1, hidden // 128)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=heads, tie_word_embeddings=False)
    config.torch_dtype = "bfloat16"
    config.save_pretrained(base)
    (base / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    (base / "tokenizer.json").write_text("{}")
    linears = {"self_attn.q_proj": (hidden, hidden), "self_attn.k_proj": (hidden, hidden),
               "self_attn.v_proj": (hidden, hidden), "self_attn.o_proj": (hidden, hidden),
               "mlp.gate_proj": (intermediate, hidden), "mlp.up_proj": (intermediate, hidden),
               "mlp.down_proj": (hidden, intermediate)}
    shapes = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(layers):
        shapes[f"model.layers.{i}.input_layernorm.weight"] = (hidden,)
        shapes[f"model.layers.{i}.post_attention_layernorm.weight"] = (hidden,)
        for name, shape in linears.items():
            shapes[f"model.layers.{i}.{name}.weight"] = shape
    shapes["model.norm.weight"] = (hidden,)
    shapes["lm_head.weight"] = (vocab, hidden)
    generator = torch.Generator().manual_seed(seed)
    names = list(shapes)
    halves = [names[: len(names) // 2], names[len(names) // 2:]]
    weight_map = {}
    for number, part in enumerate(halves, start=1):
        file = f"model-{number:05d}-of-00002.safetensors"
        infos = [TensorInfo(n, torch.bfloat16, shapes[n]) for n in part]
        write_file(base / file, infos, (torch.randn(shapes[n], generator=generator).to(torch.bfloat16) * 0.02
                                        for n in part))
        weight_map.update({n: file for n in part})
    (base / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    out = root / "out"
    out.mkdir()
    adapter_infos, adapter_tensors = [], []
    for i in range(layers):
        for name, (rows, cols) in linears.items():
            prefix = f"base_model.model.model.layers.{i}.{name}"
            for key, shape in ((f"{prefix}.lora_A.weight", (rank, cols)), (f"{prefix}.lora_B.weight", (rows, rank))):
                adapter_infos.append(TensorInfo(key, torch.float32, shape))
                adapter_tensors.append(torch.randn(shape, generator=generator) * 0.01)
    write_file(out / "adapter_model.safetensors", adapter_infos, iter(adapter_tensors))
    (out / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
                                                         "target_modules": [n.split(".")[-1] for n in linears],
                                                         "fan_in_fan_out": False, "use_rslora": False}))
    # What a full fine-tune's Trainer save holds with fp32 master weights (for the full export).
    full_out = root / "full-out"
    full_out.mkdir()
    for number, part in enumerate(halves, start=1):
        file = f"model-{number:05d}-of-00002.safetensors"
        infos = [TensorInfo(n, torch.float32, shapes[n]) for n in part]
        write_file(full_out / file, infos, (torch.randn(shapes[n], generator=generator) * 0.02 for n in part))
    (full_out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    params = sum(math.prod(s) for s in shapes.values())
    return {"base": base, "out": out, "full_out": full_out, "params": params, "config": config}


def run_child(args: dict) -> tuple[int, dict]:
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("BENCH_THREADS", "1"), HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    process = subprocess.Popen([sys.executable, "-c", CHILD, json.dumps(args)], stdout=subprocess.PIPE, env=env,
                               text=True)
    out = process.stdout.read()
    if process.wait() != 0:
        raise SystemExit(f"child failed ({process.returncode}): {out}")
    facts = json.loads(out.strip().splitlines()[-1])
    return facts["peak"], facts


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args()

    from finetune_operator.sizing.architecture import ModelArchitecture
    from finetune_operator.sizing.constants import HOST_PROCESS_BYTES
    from finetune_operator.sizing.export import MERGE_OVERHEAD_BYTES, estimate_export

    rows = []
    with tempfile.TemporaryDirectory(prefix="export-bench-") as tmp:
        model = build(Path(tmp), args.vocab, args.hidden, args.intermediate, args.layers, args.rank)
        arch = ModelArchitecture(family="llama", vocab_size=args.vocab, hidden_size=args.hidden,
                                 intermediate_size=args.intermediate, num_layers=args.layers,
                                 num_attention_heads=model["config"].num_attention_heads,
                                 num_key_value_heads=model["config"].num_key_value_heads)
        cases = [("merged", "bfloat16", "bf16", str(model["out"])),
                 ("merged", "float32", "fp32", str(model["out"])),
                 ("full", "bfloat16", "bf16", str(model["full_out"]))]
        for kind, dtype, precision, output in cases:
            child = {"kind": kind, "output": output, "base": str(model["base"]), "dtype": dtype}
            runtime, _ = run_child({**child, "merge": False})
            peak, facts = run_child({**child, "merge": True})
            estimate = estimate_export(arch, export=kind, method="lora" if kind == "merged" else "full",
                                       precision=precision, stored_bytes=2, trained_bytes=4)
            written = sum(p.stat().st_size for p in (Path(output) / kind).glob("*.safetensors"))
            rows.append({"export": kind, "dtype": precision, "params": model["params"],
                         "measuredPeakRssBytes": peak, "measuredRuntimeRssBytes": runtime,
                         "measuredMergeBytes": peak - runtime,
                         "estimatedWorkingSetBytes": estimate.working_set_bytes + estimate.overhead_bytes,
                         "estimatedHostBytes": estimate.host_bytes, "sampledPeakRssBytes": facts["sampledPeakRss"],
                         "writtenBytes": written, "estimatedDiskBytes": estimate.disk_bytes,
                         "shards": facts["shards"], "seconds": facts["seconds"]})
    print(f"model: Llama-shaped, vocab {args.vocab}, hidden {args.hidden}, intermediate {args.intermediate}, "
          f"{args.layers} layers, {rows[0]['params'] / 1e6:.0f}M parameters (bf16 base {2 * rows[0]['params'] / MiB:.0f} MiB), "
          f"LoRA r={args.rank} on every block linear")
    print(f"{'export':<8}{'dtype':<6}{'peak RSS':>10}{'runtime':>10}{'merge':>10}{'est. merge':>12}{'ratio':>7}"
          f"{'est. host':>11}{'sampled':>10}{'written':>10}{'est. disk':>11}{'s':>7}")
    for r in rows:
        print(f"{r['export']:<8}{r['dtype']:<6}{r['measuredPeakRssBytes'] / MiB:>8.0f}Mi{r['measuredRuntimeRssBytes'] / MiB:>8.0f}Mi"
              f"{r['measuredMergeBytes'] / MiB:>8.0f}Mi{r['estimatedWorkingSetBytes'] / MiB:>10.0f}Mi"
              f"{r['measuredMergeBytes'] / max(1, r['estimatedWorkingSetBytes']):>7.2f}"
              f"{r['estimatedHostBytes'] / MiB:>9.0f}Mi{r['sampledPeakRssBytes'] / MiB:>8.0f}Mi{r['writtenBytes'] / MiB:>8.0f}Mi{r['estimatedDiskBytes'] / MiB:>9.0f}Mi"
              f"{r['seconds']:>7.1f}")
    print(f"merge = peak RSS - runtime (the same process without the merge); est. merge = the largest tensor's working"
          f" set + {MERGE_OVERHEAD_BYTES / MiB:.0f}Mi overhead; est. host = HOST_PROCESS_BYTES ({HOST_PROCESS_BYTES / MiB:.0f}Mi,"
          " a training process's runtime) + est. merge; sampled = the trainer's own RSS samples (ExportResult)")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

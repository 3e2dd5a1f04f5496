"""The lean-trainer levers on one real GPU: measured peak memory against the estimate (issue 13).

    python bench/gpu_levers.py --help
    python bench/gpu_levers.py --dry-run            # the cases and their estimates; no GPU needed
    python bench/gpu_levers.py                      # run them (CUDA; about 4-5 minutes on one H200)
    python bench/gpu_levers.py --cases full-fp32,full-bf16-kahan

A Llama-3.2-1B built from its config (finetune_operator.sizing's preset, random bf16
weights written once to a temporary folder, the tests' word-level tokenizer, packed text
of 2048 tokens per sample) is trained by the real trainer (``python -m finetune_trainer``,
one process per case, a fresh CUDA context each) for a few steps with each lever, alone
and stacked as torchtune's low-memory ladder does. For each case it records:

* ``allocated``: the trainer's own max_memory_allocated (its last progress line);
* ``reserved``: its max_memory_reserved;
* ``host``: the host bytes activation offloading held at once (the trainer's
  ``activation-offload`` line), against the estimate's host term;
* ``device``: the device's used memory at its highest while the case ran (sampled
  every 50 ms with mem_get_info, minus what was in use before it started). This is the
  figure that includes paged 8-bit AdamW states in CUDA unified memory, which torch's
  allocator never sees, and the CUDA context;

next to the estimate of ``finetune_operator.sizing.estimate_memory`` for the same setup
(peak allocated, required = reserved incl. fragmentation and reserve, unified memory,
host bytes of activation offloading). The table goes to stdout, every case as JSON to
``$OUT/gpu_levers.json`` when OUT is set (else bench/results/gpu_levers.json).

QLoRA sharded by FSDP needs two ranks on two GPUs (NCCL refuses two ranks on one
device). On one GPU the ``qlora-fsdp-path`` case runs the trainer's FSDP route for QLoRA
(accelerate FSDP2 over the 4-bit base stored as bf16, CPU offload of the shards) on a
one-rank mesh, forced through a wrapper: no memory is saved by sharding over one rank,
but the CUDA-only code path (bitsandbytes Params4bit under fully_shard, peft adapters,
the trainer's checkpoints) runs for real. ``--nproc 2`` on a machine with two GPUs runs
that case sharded across them.

Liger's kernels (``training.ligerKernel``, issue 28): their memory term (sizing/activations.py,
modelled from liger-kernel 0.8.5's source) is unchecked until this script runs them: the
``*-liger`` cases sit beside the chunked loss they replace (``--cases
lora-chunked,lora-liger,full-bf16-chunked,full-bf16-liger`` runs just those four, about 2
minutes). They need the liger-kernel package (the trainer image pins 0.8.5; elsewhere put it on
PYTHONPATH, which the cases' trainer processes keep), else the trainer refuses them naming the field.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GIB = 1 << 30
PRESET = "llama-3.2-1b"
STEPS = 3
CASE_TIMEOUT_S = 150
TOTAL_BUDGET_S = 285  # stop starting cases after this: the whole run stays under 5 minutes


@dataclass(frozen=True)
class Case:
    name: str
    what: str
    trainer: dict  # TrainerConfig fields (camelCase) on top of the common ones
    setup: dict = field(default_factory=dict)  # TrainingSetup fields for the estimate
    force_fsdp_route: bool = False


def _full(**levers) -> tuple[dict, dict]:
    names = {"masterWeights": "master_weights", "updateRounding": "update_rounding",
             "optimizerInBackward": "optimizer_in_backward", "lossChunks": "loss_chunks",
             "activationOffloading": "activation_offloading", "optimizer": "optimizer", "ligerKernel": "liger_kernel"}
    trainer = {"method": "full", **levers}
    if levers.get("optimizerInBackward"):
        trainer["maxGradNorm"] = 0
    setup = {"method": "full", **{names[k]: v for k, v in levers.items()}}
    return trainer, setup


def cases() -> list[Case]:
    out = []
    ladder = [
        ("full-fp32", "fp32 master weights (today's trainer)", {}),
        ("full-bf16", "bf16 weights, grads, AdamW states", {"masterWeights": "bf16"}),
        ("full-bf16-kahan", "+ Kahan buffers", {"masterWeights": "bf16", "updateRounding": "kahan"}),
        ("full-bf16-stochastic", "stochastic rounding", {"masterWeights": "bf16", "updateRounding": "stochastic"}),
        ("full-bf16-chunked", "+ lossChunks 8", {"masterWeights": "bf16", "lossChunks": 8}),
        ("full-bf16-liger", "Liger's kernels in place of lossChunks 8", {"masterWeights": "bf16", "ligerKernel": True}),
        ("full-bf16-chunked-oib", "+ optimizer step in backward",
         {"masterWeights": "bf16", "lossChunks": 8, "optimizerInBackward": True}),
        ("full-bf16-chunked-oib-offload", "+ activation offloading",
         {"masterWeights": "bf16", "lossChunks": 8, "optimizerInBackward": True, "activationOffloading": True}),
        ("full-bf16-paged8bit-oib", "torchtune low-memory: bf16, paged 8-bit AdamW, step in backward",
         {"masterWeights": "bf16", "optimizer": "paged-adamw-8bit", "optimizerInBackward": True, "lossChunks": 8}),
    ]
    for name, what, levers in ladder:
        trainer, setup = _full(**levers)
        out.append(Case(name, what, trainer, setup))
    lora = {"lora": {"rank": 16, "alpha": 32, "dropout": 0.05}}
    out.append(Case("lora-chunked", "LoRA r16 + lossChunks 8", {"method": "lora", "lossChunks": 8, **lora},
                    {"method": "lora", "lora_rank": 16, "loss_chunks": 8}))
    out.append(Case("lora-liger", "LoRA r16 + Liger's kernels", {"method": "lora", "ligerKernel": True, **lora},
                    {"method": "lora", "lora_rank": 16, "liger_kernel": True}))
    out.append(Case("qlora", "QLoRA r16, one GPU (DDP path)", {"method": "qlora", **lora},
                    {"method": "qlora", "lora_rank": 16}))
    out.append(Case("qlora-fsdp-path", "QLoRA through the FSDP route (accelerate FSDP2, bf16 quant storage, "
                                       "CPU offload)",
                    {"method": "qlora", "strategy": "fsdp", "offload": "optimizer+params", **lora},
                    {"method": "qlora", "lora_rank": 16, "strategy": "fsdp", "offload": "optimizer+params"},
                    force_fsdp_route=True))
    # Issue 28: QLoRA under DeepSpeed ZeRO-3 (4-bit codes stored in bf16, partitioned by zero.Init; no
    # fp32 cast of the rest), one rank under torchrun. The CPU checks only its partitioning, with
    # emulated 4-bit layers (bench/zero_truth.py --qlora): bitsandbytes needs CUDA.
    sys.path.insert(0, str(ROOT / "images" / "trainer"))
    from finetune_trainer.contract import deepspeed_config

    out.append(Case("qlora-zero3", "QLoRA r16 under DeepSpeed ZeRO-3 (bf16 quant storage), one rank",
                    {"method": "qlora", "strategy": "zero3", "deepspeed": deepspeed_config(3), **lora},
                    {"method": "qlora", "lora_rank": 16, "strategy": "zero3"}))
    return out


COMMON = {"precision": "bf16", "sequenceLength": 2048, "microBatchSize": 2, "gradientAccumulation": 1,
          "gradientCheckpointing": True, "learningRate": 1e-5, "maxSteps": STEPS, "logEverySteps": 1}


def estimate(case: Case, world: int) -> dict:
    sys.path.insert(0, str(ROOT / "operator"))
    from finetune_operator.sizing import TrainingSetup, estimate_memory
    from finetune_operator.sizing.presets import preset

    # On one GPU the FSDP route runs over a one-rank mesh: estimated as fsdp on 1 GPU.
    setup = TrainingSetup(architecture=preset(PRESET), micro_batch_size=2,
                          sequence_length=2048, gradient_checkpointing=True, world_size=world, **case.setup)
    result = estimate_memory(setup)
    return {"peakAllocatedGiB": result.peak_allocated_bytes / GIB, "requiredGiB": result.required_bytes / GIB,
            "unifiedGiB": getattr(result, "unified_memory_bytes", 0) / GIB,
            "activationOffloadGiB": getattr(result, "activation_offload_bytes", 0) / GIB,
            "peakPhase": result.peak_phase}


# ------------------------------------------------------------------------ the GPU run


def build_assets(folder: Path, smoke: bool = False) -> dict[str, Path]:
    """The 1B model (random bf16 weights), a tokenizer, packed text. ``smoke``: one layer,
    hidden 64, built on the CPU (the --cpu-smoke check of this script's own code)."""
    import torch
    import transformers

    sys.path.insert(0, str(ROOT / "operator"))
    sys.path.insert(0, str(ROOT / "tests"))
    from finetune_operator.sizing.presets import preset
    from trainer.trainer_assets import build_tokenizer, text_lines, write_jsonl

    model_dir = folder / PRESET
    build_tokenizer(model_dir)
    hf_config = preset(PRESET).to_hf_config()
    if smoke:
        hf_config.update(num_hidden_layers=1, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, vocab_size=1024)
    config = transformers.AutoConfig.for_model(**hf_config)
    torch.manual_seed(0)
    with torch.device("cpu" if smoke else "cuda"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(model_dir)
    del model
    torch.cuda.empty_cache()
    # ~20 tokens a line; 4000 lines pack into ~40 samples of 2048 tokens.
    return {"model": model_dir, "text": write_jsonl(folder / "text.jsonl", text_lines(4000))}


class DevicePeak:
    """The device's used memory at its highest while running, sampled every 50 ms."""

    def __init__(self, enabled: bool = True):
        import torch

        self.torch = torch
        self.enabled = enabled
        free, total = torch.cuda.mem_get_info() if enabled else (0, 0)
        self.baseline = total - free
        self.peak = self.baseline
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            free, total = self.torch.cuda.mem_get_info()
            self.peak = max(self.peak, total - free)
            time.sleep(0.05)

    def __enter__(self):
        if self.enabled:
            self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        if self.enabled:
            self._thread.join()

    @property
    def used_bytes(self) -> int:
        return self.peak - self.baseline


FORCE_ROUTE = """
import sys
import finetune_trainer.model_setup as ms
ms.fsdp_route = lambda cfg, world: ms.FSDP_ACCELERATE if cfg.strategy == "fsdp" else ms.FSDP_NONE
from finetune_trainer.run import main
sys.exit(main(sys.argv[1:]))
"""


def run_case(case: Case, assets: dict[str, Path], folder: Path, nproc: int, smoke: bool = False) -> dict:
    config = {"jobName": case.name, "model": {"path": str(assets["model"])},
              "dataset": {"path": str(assets["text"]), "format": "text", "packing": True},
              "outputDirectory": str(folder / "out"), "reportPath": str(folder / "report"), **COMMON,
              **case.trainer}
    if smoke:
        config["sequenceLength"] = 128
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    # The trainer first; what PYTHONPATH held stays after it (liger-kernel where it is not installed).
    path = os.pathsep.join(p for p in (str(ROOT / "images" / "trainer"), os.environ.get("PYTHONPATH", "")) if p)
    env = dict(os.environ, PYTHONPATH=path, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1",
               TOKENIZERS_PARALLELISM="false", **({"OMP_NUM_THREADS": "1"} if smoke else {}))
    # torchrun also for one rank on the forced route: accelerate applies FSDP only in a
    # distributed launch (LOCAL_RANK set), else it would silently run unsharded.
    # DeepSpeed too: it needs torchrun's distributed environment, even for one rank.
    if case.force_fsdp_route or (nproc > 1 and case.trainer.get("strategy") == "fsdp") \
            or case.trainer.get("strategy", "").startswith("zero"):
        script = folder / "entry.py"
        script.write_text(FORCE_ROUTE if case.force_fsdp_route else "from finetune_trainer.run import main\n"
                                                                      "import sys; sys.exit(main(sys.argv[1:]))\n")
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
                   str(script), "--config", str(folder / "config.json")]
    else:
        command = [sys.executable, "-m", "finetune_trainer", "--config", str(folder / "config.json")]
    started = time.time()
    last, events, tail = None, [], []
    with DevicePeak(enabled=not smoke) as device:
        child = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            for line in child.stdout:
                tail = (tail + [line])[-40:]
                if line.startswith('{"event"'):
                    event = json.loads(line)
                    events.append(event)
                    if event["event"] == "progress" and event.get("rank", 0) == 0:
                        last = event
                        if event["step"] >= STEPS:
                            break  # measured; writing the output model is not what this is about
                if time.time() - started > CASE_TIMEOUT_S:
                    break
        finally:
            child.terminate()
            try:
                child.wait(timeout=30)
            except subprocess.TimeoutExpired:
                child.kill()
    failure = next((e for e in events if e["event"] == "failure"), None)
    result = {"case": case.name, "what": case.what, "seconds": round(time.time() - started, 1),
              "ok": last is not None and last["step"] >= STEPS, "deviceUsedGiB": device.used_bytes / GIB}
    if last:
        result.update(allocatedGiB=last.get("peakAllocatedBytes", 0) / GIB,
                      reservedGiB=last.get("peakReservedBytes", 0) / GIB, loss=last["loss"])
    if failure:
        result["failure"] = {k: failure.get(k) for k in ("reason", "phase", "message")}
    elif not result["ok"]:
        result["tail"] = "".join(tail)[-2000:]
    offload = next((e for e in events if e["event"] == "activation-offload"), None)
    if offload:
        result["activationOffloadHostGiB"] = offload["peakHostBytes"] / GIB
    levers = next((e for e in events if e["event"] == "levers"), None)
    if levers:
        result["levers"] = {k: v for k, v in levers.items() if k not in ("event", "time", "rank")}
    return result


def print_table(rows: list[dict]) -> None:
    print(f"\n{PRESET} from its config, random weights, batch 2 x 2048 packed, activation checkpointing, "
          f"{STEPS} steps; GiB per GPU")
    print(f"{'case':<32}{'est alloc':>10}{'alloc':>8}{'est req':>9}{'reserved':>9}{'device':>8}"
          f"{'est UM':>8}{'est host':>9}{'host':>7}{'alloc/est':>10}  status")
    for row in rows:
        est = row.get("estimate", {})
        measured = row.get("allocatedGiB")
        ratio = f"{measured / est['peakAllocatedGiB']:.2f}" if measured and est.get("peakAllocatedGiB") else "-"

        def num(value):
            return f"{value:.2f}" if isinstance(value, (int, float)) else "-"

        status = "ok" if row.get("ok") else ("dry-run" if "ok" not in row else
                                             (row.get("failure") or {}).get("reason", "failed"))
        print(f"{row['case']:<32}{num(est.get('peakAllocatedGiB')):>10}{num(measured):>8}"
              f"{num(est.get('requiredGiB')):>9}{num(row.get('reservedGiB')):>9}{num(row.get('deviceUsedGiB')):>8}"
              f"{num(est.get('unifiedGiB')):>8}{num(est.get('activationOffloadGiB')):>9}"
              f"{num(row.get('activationOffloadHostGiB')):>7}{ratio:>10}  {status}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gpu_levers.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="print the cases and estimates, run nothing")
    parser.add_argument("--cases", default="", help="comma-separated case names (default: all)")
    parser.add_argument("--nproc", type=int, default=1,
                        help="ranks for the qlora-fsdp-path case (needs that many GPUs; default 1)")
    parser.add_argument("--out", default=None, help="JSON output (default $OUT/gpu_levers.json or bench/results/)")
    parser.add_argument("--cpu-smoke", action="store_true",
                        help="check this script on the CPU: a 1-layer model, sequence 128, the cases that need no "
                             "bitsandbytes (measures nothing)")
    args = parser.parse_args(argv)
    if args.cpu_smoke and not args.cases:
        args.cases = "full-fp32,full-bf16-chunked-oib-offload,lora-chunked"

    chosen = [c for c in cases() if not args.cases or c.name in args.cases.split(",")]
    if not chosen:
        parser.error(f"no case named {args.cases}; known: {', '.join(c.name for c in cases())}")
    rows = []
    for case in chosen:
        world = args.nproc if case.force_fsdp_route else 1
        try:
            row = {"case": case.name, "what": case.what, "estimate": estimate(case, world)}
        except Exception as exc:  # noqa: BLE001 - a setup the estimator refuses is reported, not fatal
            row = {"case": case.name, "what": case.what, "estimate": {"error": f"{type(exc).__name__}: {exc}"}}
        rows.append(row)
    if args.dry_run:
        print_table(rows)
        return 0

    import torch

    if not torch.cuda.is_available() and not args.cpu_smoke:
        print("no CUDA device: use --dry-run (or --cpu-smoke) on this machine", file=sys.stderr)
        return 2
    out_path = Path(args.out) if args.out else (Path(os.environ["OUT"]) / "gpu_levers.json" if os.environ.get("OUT")
                                                else ROOT / "bench" / "results" / "gpu_levers.json")
    out_path.parent.mkdir(parents=True, exist_ok=True)
    started = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        assets = build_assets(Path(tmp) / "assets", smoke=args.cpu_smoke)
        gpu = "cpu (smoke)" if args.cpu_smoke else torch.cuda.get_device_name()
        print(f"assets built in {time.time() - started:.0f} s on {gpu}", flush=True)
        for row, case in zip(rows, chosen):
            if time.time() - started > TOTAL_BUDGET_S and not args.cpu_smoke:
                row["skipped"] = "time budget spent"
                continue
            row.update(run_case(case, assets, Path(tmp) / case.name, args.nproc if case.force_fsdp_route else 1,
                                smoke=args.cpu_smoke))
            print(json.dumps(row), flush=True)
            out_path.write_text(json.dumps({"gpu": gpu, "rows": rows}, indent=2))
    print_table(rows)
    print(f"\n{time.time() - started:.0f} s; JSON in {out_path}")
    return 0 if all(r.get("ok") for r in rows if "skipped" not in r) else 1


if __name__ == "__main__":
    sys.exit(main())

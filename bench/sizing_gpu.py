"""Calibrate the sizing constants on one real GPU, in one command (< 8 minutes on an H200).

For each setup of a small matrix (models that fit one GPU; our trainer's settings:
mixed precision via autocast with fp32 outputs, fused AdamW, clipping, non-reentrant
checkpointing, peft adapters in fp32) it runs two real training steps and records, for
the second step:

* max_memory_allocated   -> compared with the estimate's peak allocated bytes
* max_memory_reserved    -> reserved / allocated, printed beside sizing.allocator.reserved_bytes'
                            prediction for the case (expandable segments on, as the trainer runs,
                            unless the case says off; fixed or variable sequence lengths)
* device used (mem_get_info) - reserved -> calibrates CUDA_CONTEXT_RESERVE_BYTES

Each setup runs in its own process (a fresh CUDA context, so the device-level figure is
its own). Results go to one JSON line per setup in --out (default
$OUT/sizing_gpu.jsonl, else bench/results/sizing_gpu.jsonl), and a summary table is
printed with the suggested constants.

    python bench/sizing_gpu.py --dry-run     # print the matrix and estimates (no GPU needed)
    python bench/sizing_gpu.py --cpu-smoke --out /tmp/smoke.jsonl   # run the code path on the CPU
    python bench/sizing_gpu.py               # run it (needs CUDA; without it, exits 2 with a message)
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "operator"))
sys.path.insert(0, os.path.join(HERE, "..", "images", "trainer"))

from finetune_operator.sizing import TrainingSetup, estimate_memory  # noqa: E402
from finetune_operator.sizing.presets import preset  # noqa: E402
from finetune_operator.sizing import constants as K  # noqa: E402
from finetune_operator.sizing.allocator import reserved_bytes  # noqa: E402

GIB = 1 << 30
# A whole run must stay under 8 minutes: each case gets a hard limit, and the run stops
# starting new cases once the budget is nearly spent.
CASE_TIMEOUT_S = 75
TOTAL_BUDGET_S = 420


@dataclass(frozen=True)
class GpuCase:
    preset: str
    method: str
    batch: int
    seq: int
    gc: bool
    attention: str = "sdpa"
    optimizer: str = "adamw"
    rank: int = 16
    dropout: float = 0.05
    expandable: bool = True  # PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, as the trainer's pod sets
    variable: bool = False  # steps of lengths seq/2, 3seq/4, seq, 5seq/8 (the collator pads per batch)
    adamw: str = "fused"  # torch AdamW's path (the trainer's: fused; foreach: torch's pick on CUDA otherwise)
    saved: tuple = ()  # lora.modulesToSave (peft modules_to_save, trained in fp32 as the trainer does)
    targets: str | tuple = "all-linear"  # lora.targetModules (may name lm_head)
    # spec.dataset.paddingFree: the lengths of the examples one micro-batch lays end to end in one row
    # (positions restarting at each); `batch` is their count and `seq` the longest.
    examples: tuple = ()

    @property
    def key(self) -> str:
        return (f"{self.preset}|{self.method}|b{self.batch}|s{self.seq}|gc{int(self.gc)}|{self.attention}"
                f"|{self.optimizer}" + ("" if self.expandable else "|classic") + ("|var" if self.variable else "")
                + ("" if self.adamw == "fused" else f"|{self.adamw}") + ("|m=" + "+".join(self.saved) if self.saved else "")
                + ("" if self.targets == "all-linear" else "|t=" + "+".join(self.targets))
                + ("|free=" + "+".join(map(str, self.examples)) if self.examples else ""))

    def lengths(self) -> tuple[int, ...]:
        s = self.seq
        return (s // 2, 3 * s // 4, s, 5 * s // 8) if self.variable else (s, s)

    def predicted_factor(self) -> float:
        """Predicted reserved over allocated (allocator.reserved_bytes over the estimate's peak)."""
        setup = self.setup()
        estimate = estimate_memory(setup)
        return reserved_bytes(estimate, setup, expandable_segments=self.expandable,
                              variable_lengths=self.variable) / estimate.peak_allocated_bytes

    def setup(self) -> TrainingSetup:
        return TrainingSetup(
            architecture=preset(self.preset), method=self.method, lora_rank=self.rank,
            lora_dropout=self.dropout, micro_batch_size=self.batch, sequence_length=self.seq,
            gradient_checkpointing=self.gc, attention=self.attention, optimizer=self.optimizer,
            adamw_implementation=self.adamw, lora_modules_to_save=tuple(self.saved),
            lora_targets=self.targets if isinstance(self.targets, str) else tuple(self.targets),
            padding_free=bool(self.examples),
            # The row's exact tokens: i examples hold at most the i longest together.
            micro_batch_tokens=tuple(itertools.accumulate(sorted(self.examples, reverse=True))),
        )


# Small and mid-size models that fit one H200 (141 GB); cheapest first so a short
# budget still calibrates something.
_BLOCK_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
MATRIX = [
    GpuCase("qwen2.5-0.5b", "full", 4, 1024, False),
    GpuCase("llama-3.2-1b", "lora", 2, 2048, False),
    # Issue 28: torch's fused and foreach AdamW where the step is the peak (foreach holds one fp32 copy
    # of the trained values, fused none), lora.modulesToSave and LoRA on the head beside the row above.
    GpuCase("qwen2.5-0.5b", "full", 1, 512, True),
    GpuCase("qwen2.5-0.5b", "full", 1, 512, True, adamw="foreach"),
    GpuCase("llama-3.2-1b", "lora", 2, 2048, False, saved=("embed_tokens", "lm_head")),
    GpuCase("llama-3.2-1b", "lora", 2, 2048, False, targets=_BLOCK_LINEARS + ("lm_head",)),
    GpuCase("llama-3.2-1b", "full", 2, 2048, True),
    GpuCase("llama-3.2-1b", "lora", 1, 1024, False, attention="eager"),
    GpuCase("llama-3.2-3b", "lora", 4, 2048, True),
    GpuCase("llama-3.2-3b", "full", 1, 4096, True),
    GpuCase("phi-3-mini", "lora", 2, 2048, False),
    GpuCase("llama-3.1-8b", "lora", 1, 4096, True),
    GpuCase("qwen2.5-7b", "lora", 2, 2048, True),
    GpuCase("llama-3.2-3b", "qlora", 2, 2048, True, optimizer="paged-adamw-8bit"),
    GpuCase("llama-3.2-3b", "full", 2, 2048, True, optimizer="adamw-8bit"),
    # The allocator model's other corners: variable lengths, expandable segments off.
    GpuCase("llama-3.2-1b", "full", 2, 2048, True, variable=True),
    GpuCase("llama-3.2-1b", "full", 2, 2048, True, variable=True, expandable=False),
    GpuCase("llama-3.2-1b", "lora", 2, 2048, False, variable=True, expandable=False),
    # Padding-free rows (issue 28): flash's variable-length kernel (no mask), and sdpa's block-diagonal mask.
    GpuCase("llama-3.2-1b", "lora", 4, 1800, True, attention="flash", examples=(1800, 900, 600, 300)),
    GpuCase("llama-3.2-1b", "lora", 4, 1800, True, examples=(1800, 900, 600, 300)),
]


def run_case(case: GpuCase, device: str = "cuda") -> dict:
    """Runs inside the child process: two real steps on cuda:0 (or a 1-block smoke run on the CPU)."""
    import torch
    import transformers
    from accelerate.utils import convert_outputs_to_fp32

    torch.manual_seed(0)
    setup = case.setup()
    arch = setup.architecture
    if device == "cpu":
        arch = arch.with_layers(1)
    config = transformers.AutoConfig.for_model(**arch.to_hf_config())
    config.use_cache = False
    attn = {"sdpa": "sdpa", "flash": "flash_attention_2", "eager": "eager"}[case.attention]
    load_dtype = torch.float32 if case.method == "full" else torch.bfloat16
    quant = None
    if case.method == "qlora":
        quant = transformers.BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch.bfloat16)
    t0 = time.perf_counter()
    if quant is None:
        with torch.device(device):
            model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=load_dtype)
    else:
        # 4-bit needs a checkpoint to quantise on load: save random bf16 weights, reload quantised.
        import tempfile

        with torch.device("cuda"):
            dense = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        tmp = tempfile.mkdtemp()
        dense.save_pretrained(tmp)
        del dense
        torch.cuda.empty_cache()
        model = transformers.AutoModelForCausalLM.from_pretrained(
            tmp, quantization_config=quant, attn_implementation=attn, device_map={"": 0})
    if case.method != "full":
        import peft

        if case.method == "qlora":
            model = peft.prepare_model_for_kbit_training(model, use_gradient_checkpointing=case.gc,
                                                         gradient_checkpointing_kwargs={"use_reentrant": False})
        from finetune_trainer.model_setup import train_in_fp32

        targets = case.targets if isinstance(case.targets, str) else list(case.targets)
        model = peft.get_peft_model(model, peft.LoraConfig(r=case.rank, lora_alpha=2 * case.rank,
                                                           lora_dropout=case.dropout, target_modules=targets,
                                                           modules_to_save=list(case.saved) or None))
        train_in_fp32(model)  # modules_to_save's copies in fp32, as the trainer trains them
    if case.gc:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    if case.optimizer == "adamw":
        path = {"fused": True} if case.adamw == "fused" else {"foreach": True}
        optimizer = torch.optim.AdamW(params, lr=1e-5, **path)
    else:
        import bitsandbytes as bnb

        cls = bnb.optim.PagedAdamW8bit if case.optimizer == "paged-adamw-8bit" else bnb.optim.AdamW8bit
        optimizer = cls(params, lr=1e-5)
    forward_fn = model.__call__

    def forward(**kw):
        with torch.autocast(device, dtype=torch.bfloat16):
            return forward_fn(**kw)

    forward = convert_outputs_to_fp32(forward)
    lengths = case.lengths() if device == "cuda" else (64, 64)
    setup_s = time.perf_counter() - t0
    for step, length in enumerate(lengths):
        ids = torch.randint(0, arch.vocab_size, (case.batch if device == "cuda" else 1, length), device=device)
        extra = {}
        if case.examples:  # one row of the examples, positions restarting at each (data.Collator's flatten)
            ids = torch.randint(0, arch.vocab_size, (1, sum(case.examples)), device=device)
            extra["position_ids"] = torch.cat([torch.arange(n, device=device) for n in case.examples])[None]
        if device == "cpu":
            loss = forward(input_ids=ids, labels=ids, **extra).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            continue
        torch.cuda.synchronize()
        if step == 1:  # the peaks of the steps with optimizer state (from the second on)
            torch.cuda.reset_peak_memory_stats()
        loss = forward(input_ids=ids, labels=ids, **extra).loss
        loss.backward()
        del loss
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
    if device == "cpu":
        return {"max_allocated": 1, "max_reserved": 1, "device_used": 1, "device_total": 1, "setup_s": setup_s}
    free, total = torch.cuda.mem_get_info()
    return {
        "max_allocated": torch.cuda.max_memory_allocated(),
        "max_reserved": torch.cuda.max_memory_reserved(),
        "device_used": total - free,
        "device_total": total,
        "setup_s": setup_s,
    }


def child_main(case_json: str, device: str = "cuda") -> int:
    case = GpuCase(**json.loads(case_json))
    try:
        result = run_case(case, device)
    except Exception as error:  # reported, not raised: one failing case must not stop the run
        import traceback

        traceback.print_exc()
        result = {"error": f"{type(error).__name__}: {error}"[:500]}
    print("RESULT " + json.dumps(result))
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="print the matrix and the estimates, run nothing")
    ap.add_argument("--out", default=None)
    ap.add_argument("--only", default="")
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="run each case's code path with one block on the CPU (no bitsandbytes cases); checks the script")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ns = ap.parse_args(argv)
    if ns.child:
        return child_main(ns.child, "cpu" if ns.cpu_smoke else "cuda")

    cases = [c for c in MATRIX if ns.only in c.key]
    if ns.dry_run:
        print(f"{'setup':<70} {'est peak GiB':>12} {'est required GiB':>16} {'reserved/alloc':>15}")
        for c in cases:
            e = estimate_memory(c.setup())
            print(f"{c.key:<70} {e.peak_allocated_bytes / GIB:>12.2f} {e.required_bytes / GIB:>16.2f} "
                  f"{c.predicted_factor():>15.3f}")
        print(f"{len(cases)} setups; per-case limit {CASE_TIMEOUT_S}s, total budget {TOTAL_BUDGET_S}s")
        return 0

    if not ns.cpu_smoke and not _cuda_available():
        print("sizing_gpu.py: no CUDA device here; run it on a GPU machine "
              "(or --dry-run for the estimates, --cpu-smoke to check the code path)", file=sys.stderr)
        return 2
    out = ns.out or os.path.join(os.environ.get("OUT") or os.path.join(HERE, "results"), "sizing_gpu.jsonl")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    start = time.perf_counter()
    rows = []
    with open(out, "w") as f:
        for c in cases:
            left = TOTAL_BUDGET_S - (time.perf_counter() - start)
            if left < 20 and not ns.cpu_smoke:
                print(f"budget spent; skipping {c.key}")
                continue
            est = estimate_memory(c.setup())
            t0 = time.perf_counter()
            if ns.cpu_smoke and (c.method == "qlora" or c.optimizer != "adamw"):
                continue
            try:
                proc = subprocess.run([sys.executable, __file__, "--child", json.dumps(asdict(c))]
                                      + (["--cpu-smoke"] if ns.cpu_smoke else []), env=_child_env(c),
                                      capture_output=True, text=True, timeout=300 if ns.cpu_smoke else min(CASE_TIMEOUT_S, left))
                lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
                result = json.loads(lines[-1][7:]) if lines else {"error": proc.stderr[-500:]}
            except subprocess.TimeoutExpired:
                result = {"error": "timeout"}
            result.update(key=c.key, wall_s=time.perf_counter() - t0,
                          est_peak=est.peak_allocated_bytes, est_required=est.required_bytes,
                          predicted_factor=c.predicted_factor())
            f.write(json.dumps(result) + "\n")
            f.flush()
            rows.append(result)
            print(_row(result), flush=True)
    ok = [r for r in rows if "error" not in r]
    if ok:
        frag = [r["max_reserved"] / r["max_allocated"] for r in ok]
        ctx = [r["device_used"] - r["max_reserved"] for r in ok]
        errs = [(r["est_peak"] - r["max_allocated"]) / r["max_allocated"] * 100 for r in ok]
        print(f"\n{len(ok)} setups: median |err| {statistics.median(abs(e) for e in errs):.1f}%, "
              f"worst {max(abs(e) for e in errs):.1f}%, most negative {min(errs):+.1f}%")
        print(f"reserved/allocated: median {statistics.median(frag):.3f}, max {max(frag):.3f} "
              f"(allocator.reserved_bytes per setup)")
        gaps = [(r["predicted_factor"] - r["max_reserved"] / r["max_allocated"]) for r in ok]
        print(f"predicted - measured reserved/allocated: median {statistics.median(gaps):+.3f}, "
              f"lowest {min(gaps):+.3f} (negative: the model predicts less than measured)")
        print(f"device used - reserved: median {statistics.median(ctx) / GIB:.2f} GiB, max {max(ctx) / GIB:.2f} GiB "
              f"(CUDA_CONTEXT_RESERVE_BYTES now {K.CUDA_CONTEXT_RESERVE_BYTES / GIB:.2f} GiB)")
        underfit = [r for r in ok if r["est_required"] < r["device_used"]]
        print(f"required >= device used in {len(ok) - len(underfit)}/{len(ok)} setups")
    print(f"results: {out}; total {time.perf_counter() - start:.0f}s")
    return 0


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def _child_env(case: GpuCase) -> dict:
    # Each case runs with the allocator setting it names (the trainer's pod sets expandable segments).
    env = dict(os.environ)
    if case.expandable:
        env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    else:
        env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    return env


def _row(r: dict) -> str:
    if "error" in r:
        return f"{r['key']:<70} ERROR {r['error'][:120]}"
    err = (r["est_peak"] - r["max_allocated"]) / r["max_allocated"] * 100
    return (f"{r['key']:<70} est {r['est_peak'] / GIB:7.2f}  alloc {r['max_allocated'] / GIB:7.2f} ({err:+.1f}%)  "
            f"reserved {r['max_reserved'] / GIB:7.2f}  ratio {r['max_reserved'] / r['max_allocated']:.3f} "
            f"(predicted {r['predicted_factor']:.3f})  device {r['device_used'] / GIB:7.2f}  "
            f"required {r['est_required'] / GIB:7.2f}  {r['wall_s']:.0f}s")


if __name__ == "__main__":
    sys.exit(main())

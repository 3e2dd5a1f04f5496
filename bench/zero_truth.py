"""DeepSpeed ZeRO's real code path, measured on the CPU, beside the memory model's estimate.

    python bench/zero_truth.py [--sizes 1024x8,1536x8,2048x8,1024x16] [--worlds 2] [--stages 3] [--scale 64]

Each setup runs DeepSpeed (deepspeed.initialize with a fused torch AdamW, as the trainer's
Trainer passes adamw_torch_fused; bf16; overlap_comm and contiguous_gradients on; the trainer's
DeepSpeed config from contract.deepspeed_config) over `world` gloo ranks on the CPU
(DS_ACCELERATOR=cpu), real tensors, on a stack of `layers` blocks of a bias-free
width x width Linear and a norm-like scale vector of `width` elements (persistent under ZeRO-3:
at most stage3_param_persistence_threshold elements). Four steps: DeepSpeed's parameter trace is
complete from the third on (prefetch and reuse work only then), so the fourth is measured. Each
rank's allocated bytes are counted by the trainer's PeakTracker (every tensor storage the
dispatcher creates, plus the model's own parameters) per phase: steady (between steps), forward,
backward and the optimizer step (the peak of each).

`--scale N` divides every element budget of the trainer's ZeRO settings (buckets, prefetch, live
parameters, reuse distance, sub-group size; not the per-tensor persistence threshold) by N, so a
model of tens of millions of parameters meets them in the proportion a model of billions does.
The estimate is finetune_operator.sizing.zero3 with the same settings, on the same module trace
(stage 3) or memory.py's ZeRO-1/2 terms (stages 1, 2).

gloo's reduce-scatter copies its whole input before it reduces (NCCL's does not), which shows
as one gradient-sized buffer more in backward; the ranks therefore reduce-scatter as NCCL
allocates (an in-place all-reduce of DeepSpeed's input, whose chunk is its output), unless
--gloo-reduce-scatter keeps gloo's.

Not measured: offload (DeepSpeed's CPU Adam needs its C++ op built, and on a CPU-only host
"offload" moves nothing), CUDA streams (frees on the reduce stream are immediate here), and
activations (the batch is one token; the activation terms are checked by bench/sizing_truth.py).
Seen on the CPU: the forward peak of one size (2048x8) differs between runs by one gathered
parameter (8.4 MB: 303.8 or 312.1 MB measured, 303.7 estimated); the cause is not established.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "operator"))
sys.path.insert(0, str(ROOT / "images" / "trainer"))
sys.path.insert(0, str(ROOT / "bench"))

from cpu_ranks import run_ranks  # noqa: E402

RANK_SCRIPT = r'''
import json, os, sys
os.environ.setdefault("DS_ACCELERATOR", "cpu")
import torch, deepspeed
sys.path.insert(0, sys.argv[1])
from finetune_trainer.contract import ZERO_SETTINGS, deepspeed_config
from finetune_trainer.peak_tracker import PeakTracker
stage, width, layers, scale = int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
QLORA_RANK = 16
nccl_like = sys.argv[6] == "1"
cfg = deepspeed_config(stage, "none", ZERO_SETTINGS.scaled(scale))
world = int(os.environ["WORLD_SIZE"])
cfg.update(train_micro_batch_size_per_gpu=1, gradient_accumulation_steps=1, train_batch_size=world,
           gradient_clipping=1.0, bf16={"enabled": True}, fp16={"enabled": False})
deepspeed.init_distributed(dist_backend="gloo")
if nccl_like:
    # gloo's reduce-scatter copies its whole input first (through the dispatcher, so the tracker
    # counts it); NCCL's writes the reduced chunk into the output, no copy. DeepSpeed's output is a
    # chunk of its input, so an in-place all-reduce of the input gives the same result, as NCCL
    # would allocate it.
    import deepspeed.comm.comm as ds_comm
    import torch.distributed as tdist

    def reduce_scatter_like_nccl(output, input, op=tdist.ReduceOp.SUM, group=None, async_op=False):
        tdist.all_reduce(input, op=op, group=group)
        chunk = input.view(-1).chunk(tdist.get_world_size(group))[tdist.get_rank(group)]
        if output.data_ptr() != chunk.data_ptr():
            output.copy_(chunk.view_as(output))
        assert not async_op
        return None

    ds_comm.cdb.reduce_scatter_function = reduce_scatter_like_nccl


class Scale(torch.nn.Module):
    def __init__(self, width, trainable=True):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(width), requires_grad=trainable)

    def forward(self, x):
        return x * self.weight


def dequantise(storage, width):
    # Memory as bitsandbytes' dequantize_4bit allocates it: one compute-dtype weight of width x width
    # values from the packed codes (a quarter as many bf16 elements); the values do not matter here.
    return storage.view(-1, 1).expand(-1, 4).reshape(width, width)


class MatMul4bit(torch.autograd.Function):
    # As bitsandbytes' MatMul4Bit: saves the packed codes, not the dequantised weight, and dequantises
    # again for the input's gradient.
    @staticmethod
    def forward(ctx, x, storage, width):
        ctx.save_for_backward(storage)
        ctx.width = width
        return x @ dequantise(storage, width).T

    @staticmethod
    def backward(ctx, grad):
        (storage,) = ctx.saved_tensors
        return grad @ dequantise(storage, ctx.width), None, None


class Linear4bit(torch.nn.Module):
    # bitsandbytes' Linear4bit as ZeRO-3 sees it with bnb_4bit_quant_storage=bf16: a frozen bf16
    # parameter of the packed codes, two 4-bit codes a byte, width * width / 4 elements.
    def __init__(self, width):
        super().__init__()
        self.width = width
        self.weight = torch.nn.Parameter(torch.zeros(width * width // 4, 1), requires_grad=False)

    def forward(self, x):
        return MatMul4bit.apply(x, self.weight, self.width)


class LoraLayer(torch.nn.Module):
    # peft's LoRA layer: the base layer, then lora_A and lora_B (no dropout).
    def __init__(self, width, rank):
        super().__init__()
        self.base_layer = Linear4bit(width)
        self.lora_A = torch.nn.Linear(width, rank, bias=False)
        self.lora_B = torch.nn.Linear(rank, width, bias=False)

    def forward(self, x):
        return self.base_layer(x) + self.lora_B(self.lora_A(x))


torch.manual_seed(0)
llama = sys.argv[7] == "llama"
qlora = sys.argv[7] == "qlora"
if llama:
    # A small Llama from its config (random weights): the module tree transformers runs.
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(**json.loads(sys.argv[8])))
    model.config.use_cache = False
elif qlora:
    blocks = []
    for _ in range(layers):
        blocks += [LoraLayer(width, QLORA_RANK), Scale(width, trainable=False)]
    model = torch.nn.Sequential(*blocks)
else:
    blocks = []
    for _ in range(layers):
        blocks += [torch.nn.Linear(width, width, bias=False), Scale(width)]
    model = torch.nn.Sequential(*blocks)
decay = [p for n, p in model.named_parameters() if p.ndim > 1 and p.requires_grad]
no_decay = [p for n, p in model.named_parameters() if p.ndim == 1 and p.requires_grad]
if not no_decay:
    optimizer_groups = [{"params": decay, "weight_decay": 0.01}]
else:
    optimizer_groups = [{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}]
optimizer = torch.optim.AdamW(optimizer_groups, lr=1e-4, fused=True)
tracker = PeakTracker()
phases = {}
with tracker:
    for p in model.parameters():
        tracker.track(p)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=cfg)
    if llama:
        x = torch.randint(0, model.config.vocab_size, (1, 2))  # two tokens: activations of a few kB
    else:
        x = torch.randn(1, width, dtype=torch.bfloat16)
    for step in range(4):
        phases = {"steady": tracker.current}
        tracker.reset_peak()
        tracker.mark("forward")
        loss = engine(input_ids=x, labels=x).loss if llama else engine(x).float().sum()
        tracker.mark("backward")
        engine.backward(loss)
        tracker.mark("step")
        engine.step()
        phases.update({k: tracker.phase_peaks[k] for k in ("forward", "backward", "step")})
print(json.dumps(phases))
'''

PHASES = ("steady", "forward", "backward", "step")


def llama_config(width: int, layers: int) -> dict:
    """A small Llama (Llama 2's proportions: no GQA, MLP 2.6875 x hidden, heads of 64) of `layers` blocks."""
    return {"vocab_size": 4096, "hidden_size": width, "intermediate_size": int(width * 2.6875) // 64 * 64,
            "num_hidden_layers": layers, "num_attention_heads": width // 64, "num_key_value_heads": width // 64,
            "max_position_embeddings": 256, "tie_word_embeddings": False}


def run(stage: int, world: int, width: int, layers: int, scale: int, port: int, nccl_like: bool = True,
        model: str = "stack") -> dict[str, int]:
    """The fullest rank's figures per phase (`model`: stack, llama or qlora). A rank that aborts inside
    gloo ("terminate called without an active exception": 2 of about 20 runs here, at random sizes) is
    run again once, on another port."""
    try:
        return _run(stage, world, width, layers, scale, port, nccl_like, model)
    except RuntimeError as exc:
        if "terminate called without an active exception" not in str(exc):
            raise
        print(f"  (a rank aborted inside gloo; running {width}x{layers} again)", file=sys.stderr, flush=True)
        return _run(stage, world, width, layers, scale, port + 500, nccl_like, model)


def _run(stage: int, world: int, width: int, layers: int, scale: int, port: int, nccl_like: bool,
         model: str) -> dict[str, int]:
    results = run_ranks(RANK_SCRIPT, [str(stage), str(width), str(layers), str(scale), "1" if nccl_like else "0",
                                      model, json.dumps(llama_config(width, layers))],
                        world, port, f"stage {stage} world {world}")
    return {k: max(r[k] for r in results) for k in PHASES}  # the fullest rank per phase


def bench_trace(width: int, layers: int):
    """The bench model's module trace as DeepSpeed's hooks see it (the Sequential, then each
    Linear and Scale; backward in reverse)."""
    from finetune_operator.sizing.zero3 import ModuleTrace, Param

    params, modules = [], [()]  # module 0: the Sequential
    for _ in range(layers):
        params.append(Param(width * width))
        modules.append((len(params) - 1,))
        params.append(Param(width, no_decay=True))
        modules.append((len(params) - 1,))
    forward = tuple(range(len(modules)))
    backward = (0,) + tuple(range(len(modules) - 1, 0, -1))
    return ModuleTrace(tuple(params), tuple(modules), forward, backward)


QLORA_RANK = 16  # the rank script's


def qlora_bench_trace(width: int, layers: int):
    """The QLoRA bench model's module trace: per block peft's LoRA layer (a container: the 4-bit base
    layer, whose frozen bf16 storage holds zero3.nf4_storage_elements of its values, then lora_A and
    lora_B) and a frozen scale. The first base layer reads the input, which needs no gradient: its
    backward hooks never fire."""
    from finetune_operator.sizing.zero3 import ModuleTrace, Param, nf4_storage_elements

    params, modules, forward, backward_blocks = [], [()], [0], []
    for _ in range(layers):
        container = len(modules)
        modules.append(())
        own = []
        for numel, trainable in ((nf4_storage_elements(width * width), False), (QLORA_RANK * width, True),
                                 (width * QLORA_RANK, True)):
            params.append(Param(numel, trainable))
            modules.append((len(params) - 1,))
            own.append(len(modules) - 1)
        params.append(Param(width, trainable=False))
        modules.append((len(params) - 1,))
        forward += [container, *own, len(modules) - 1]
        base, a, b = own
        backward_blocks.append([len(modules) - 1, container, b, a, base])
    backward_blocks[0].pop()  # the first base layer: no gradient flows into it
    backward = (0,) + tuple(m for block in reversed(backward_blocks) for m in block)
    return ModuleTrace(tuple(params), tuple(modules), tuple(forward), backward)


def estimate(stage: int, world: int, width: int, layers: int, scale: int, llama: bool = False,
             qlora: bool = False) -> dict[str, float]:
    """The memory model's figure for each phase of the bench model (no activations to speak of:
    one token, or two for the Llama). QLoRA: beside stage 3's terms, the dequantised weight of the
    module that runs (memory.py's `_dequantised_weight`, in forward and backward)."""
    from finetune_operator.sizing import ModelArchitecture
    from finetune_operator.sizing.zero3 import decoder_trace, rank_memory
    from finetune_trainer.contract import ZERO_SETTINGS

    settings = ZERO_SETTINGS.scaled(scale)
    dequantised = 0.0
    if llama:
        arch = ModelArchitecture.from_hf_config(dict(llama_config(width, layers), model_type="llama"))
        trace = decoder_trace(arch, "full", 16, "all-linear", False, False)
    elif qlora:
        trace = qlora_bench_trace(width, layers)
        dequantised = 2.0 * width * width
    else:
        trace = bench_trace(width, layers)
    params = sum(p.numel for p in trace.params)
    if stage == 3:
        m = rank_memory(trace, world=world, compute_bytes=2, optimizer_bytes_per_param=8, settings=settings)
        steady = m.weights + m.persistent + m.master + m.optimizer + m.gradients + m.reduce_bucket
        return {"steady": steady, "forward": steady + m.gathered_forward + dequantised,
                "backward": steady + m.gathered_backward + dequantised,
                "step": steady + m.step_above_start, "_terms": asdict(m)}
    weights, grads = 2.0 * params, 2.0 * params / (world if stage == 2 else 1)
    states = 12.0 * params / world
    buckets = 2 * 2 * settings.reduce_bucket_size
    steady = weights + states + buckets
    return {"steady": steady, "forward": steady, "backward": steady + grads, "step": steady + grads}


def llama_params(width: int, layers: int) -> int:
    from finetune_operator.sizing import ModelArchitecture

    return ModelArchitecture.from_hf_config(dict(llama_config(width, layers), model_type="llama")).total_params


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="1024x8,1536x8,2048x8,1024x16", help="width x layers, comma-separated")
    ap.add_argument("--llama", action="store_true",
                    help="a small transformers Llama (hidden x layers) instead of the Linear stack: the estimate"
                         " replays the decoder trace sizing builds for any Llama (sizing/zero3.decoder_trace)")
    ap.add_argument("--qlora", action="store_true",
                    help="QLoRA's layers: bitsandbytes' 4-bit base emulated (its packed codes in a frozen bf16"
                         " parameter, as bnb_4bit_quant_storage=bf16 stores them, dequantised per call) under"
                         " peft's LoRA pair; the estimate replays zero3.rank_memory over that trace")
    ap.add_argument("--worlds", default="2")
    ap.add_argument("--stages", default="3")
    ap.add_argument("--scale", type=int, default=64)
    ap.add_argument("--gloo-reduce-scatter", action="store_true",
                    help="keep gloo's reduce-scatter (it copies its input; NCCL's does not)")
    ap.add_argument("--json", action="store_true")
    ns = ap.parse_args(argv)
    mb = 1e6
    rows = []
    port = 29700 + os.getpid() % 1000
    print(f"peak allocated per rank (the fullest rank), MB; settings scaled 1/{ns.scale}")
    print(f"{'size':>8} {'params':>7} {'stage':>5} {'world':>5} " +
          " ".join(f"{ph + ' meas/est':>20} {'err':>6}" for ph in PHASES))
    for size in ns.sizes.split(","):
        width, layers = (int(v) for v in size.lower().split("x"))
        for stage in [int(s) for s in ns.stages.split(",")]:
            for world in [int(w) for w in ns.worlds.split(",")]:
                port += 1
                model = "llama" if ns.llama else "qlora" if ns.qlora else "stack"
                measured = run(stage, world, width, layers, ns.scale, port, not ns.gloo_reduce_scatter, model)
                predicted = estimate(stage, world, width, layers, ns.scale, ns.llama, ns.qlora)
                cells = []
                for ph in PHASES:
                    err = predicted[ph] / measured[ph] - 1
                    cells.append(f"{measured[ph] / mb:>9.1f}/{predicted[ph] / mb:>9.1f} {err:>+6.1%}")
                params = (llama_params(width, layers) if ns.llama else
                          sum(p.numel for p in (qlora_bench_trace if ns.qlora else bench_trace)(width, layers).params))
                print(f"{size:>8} {params / 1e6:>6.1f}M {stage:>5} {world:>5} " + " ".join(cells), flush=True)
                rows.append({"size": size, "stage": stage, "world": world, "measured": measured,
                             "estimate": {k: v for k, v in predicted.items()}})
    if ns.json:
        print(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

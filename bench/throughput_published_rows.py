"""Published, measured fine-tuning throughput: the rows bench/throughput_published.py compares the
planner's step-time model (operator/finetune_operator/planning/throughput.py) with.

Every figure is converted to tokens per second per GPU; `published` says what the source printed
and how it was converted. Numbers only, each with its source; nothing else is taken from them.

`split`: "in-sample" rows were the ones looked at while the model's constants and formulas were
adjusted (issue 28 item 5); "held-out" rows were not printed until the change was done, and their
error is the honest one. The split is by source: torchtune's tables are in-sample; Answer.AI's
fsdp_qlora benchmarks and torchtitan's are held out.

GPU peaks that are not in the operator's GPU table (consumer and workstation cards) are the
vendors' dense BF16 tensor figures with FP32 accumulation (what mixed-precision training uses):
RTX 4090 165.2, RTX 3090 71 (GeForce cards run FP32 accumulation at half rate; Ada and Ampere
GA102 whitepapers), RTX A6000 154.8, RTX A5000 111.1, RTX 6000 Ada 364.2 TFLOPS (data sheets:
half of the with-sparsity figure).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

TORCHTUNE_README = "https://github.com/pytorch/torchtune/blob/bd2a0fc7c31430972728494fa01aaeeb0ebf1ba1/README.md"
TORCHTUNE_MULTINODE = ("https://github.com/pytorch/torchtune/blob/bd2a0fc7c31430972728494fa01aaeeb0ebf1ba1/"
                       "docs/source/tutorials/multinode.rst")
FSDP_QLORA = "https://github.com/AnswerDotAI/fsdp_qlora/blob/05ed9f2a60f96a0795cb082bceab70a9b19fd213/benchmarks_03_2024.md"
TORCHTITAN = ("https://github.com/pytorch/torchtitan/blob/b5bcd76c66d0acb1a08b176d9639425bc55e0b2a/"
              "benchmarks/llama3_h100_202412_torchtitan.md")

from published_models import LLAMA2_7B, LLAMA2_70B, MISTRAL_7B_V02, YI_34B  # noqa: E402, F401


@dataclass(frozen=True)
class Gpu:
    """The GPU of a published run, as a catalog pool entry would name it."""

    gpu_type: str  # a type the GPU table knows, or a card it does not (then memory and peak are given)
    intra_node: str  # how the run's GPUs were connected: "nvlink" or "pcie"
    memory: str | None = None  # only for a type the table does not know
    peak_tflops: float | None = None  # only for a type the table does not know (see the module docstring)


H100 = Gpu("H100-80GB", "nvlink")
A100_80 = Gpu("A100-80GB", "nvlink")
A100_40 = Gpu("A100-40GB", "nvlink")
RTX4090 = Gpu("RTX-4090", "pcie", "24564Mi", 165.2)
RTX3090 = Gpu("RTX-3090", "pcie", "24576Mi", 71.0)
A6000 = Gpu("RTX-A6000", "pcie", "49140Mi", 154.8)
A5000 = Gpu("RTX-A5000", "pcie", "24564Mi", 111.1)
A6000_ADA = Gpu("RTX-6000-Ada", "pcie", "49140Mi", 364.2)

# LoRA targets: torchtune's configs (q, v, output projections and the MLP); fsdp_qlora's "all".
TORCHTUNE_TARGETS = ("q_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ALL_LINEAR = "all-linear"


@dataclass(frozen=True)
class Row:
    key: str
    source: str  # URL of the file (pinned commit) the figure is printed in
    model: str | dict[str, Any]  # a preset name, or a config.json mapping
    model_name: str
    method: str  # full, lora, qlora
    gpu: Gpu
    gpus: int
    strategy: str  # ddp (one GPU, or FSDP NO_SHARD), fsdp (FULL_SHARD)
    micro_batch: int
    sequence_length: int
    gradient_checkpointing: bool
    tokens_per_s: float  # the published figure, converted to tokens/s (per GPU or per run: `per`)
    published: str  # the figure as printed, and the conversion
    differences: str  # what the published setup does that the model does not know about
    split: str  # in-sample or held-out
    nodes: int = 1
    accumulation: int = 1
    offload: str = "none"
    precision: str = "bf16"
    lora_rank: int = 16
    lora_targets: str | tuple[str, ...] = ALL_LINEAR
    not_expressible: str | None = None  # why the model cannot be asked about this setup at all
    per: str = "GPU"  # "GPU": tokens/s of one GPU; "run": of all the run's GPUs together
    compiled: bool = False  # torch.compile on (the operator's trainer runs eager)
    extra: dict = field(default_factory=dict)

    @property
    def tokens_per_s_per_gpu(self) -> float:
        return self.tokens_per_s / (self.nodes * self.gpus) if self.per == "run" else self.tokens_per_s


def _answerai_rate(seconds: float, gpus: int, context: int = 2048, samples: int = 1024) -> float:
    """fsdp_qlora's tables print the wall time of an epoch of `samples` sequences of `context`
    tokens over all GPUs (the note on the Mistral rows confirms: 483 s for 1024 x 2048 is the
    2,200 tokens/s it quotes per GPU)."""
    return samples * context / seconds / gpus


def _tt(key, model, name, method, gpu, gpus, tps, *, strategy="ddp", rank=8, ckpt=True, offload="none",
        differences="", seq=2048, micro=2, split="in-sample", source=TORCHTUNE_README, published=None,
        not_expressible=None, compiled=True, per="GPU"):
    if per == "run":
        published = published or (f"{tps:g} tokens/s, read as the run's rate: the recipe logs it as "
                                   "tokens_per_second_per_gpu, but per GPU it would need several times the "
                                   "A100's peak (see the implied utilisation)")
    return Row(
        key=key, source=source, model=model, model_name=name, method=method, gpu=gpu, gpus=gpus, strategy=strategy,
        micro_batch=micro, sequence_length=seq, gradient_checkpointing=ckpt, tokens_per_s=tps,
        published=published or f"{tps:g} tokens/s (the recipe logs tokens_per_second_per_gpu)",
        differences=differences, split=split, offload=offload, lora_rank=rank,
        lora_targets=TORCHTUNE_TARGETS if method != "full" else ALL_LINEAR, not_expressible=not_expressible,
        compiled=compiled, per=per,
    )


_TT_README = ("torch.compile on (the operator's trainer runs eager); packed 2048-token samples; the recipe "
              "counts every token of the batch (tokens.numel() at the README's commit)")
_A6000_SUSPECT = ("the RTX A6000 rows run 1.5x faster than the RTX 4090 rows, whose peak is higher (165 against "
                  "155 TFLOPS); LoRA would need more than the A6000's whole peak: the card was probably another "
                  "(an RTX 6000 Ada?) or the setup differs from the note")
_TT_FLAGS = "packed 4096-token samples; A100 memory size not stated (80 GB: 60 GiB peak)"

TORCHTUNE = [
    # README "Memory and training speed": batch 2, no accumulation, packed to 2048, compile on.
    # Configs llama3_1/8B_*_single_device: activation checkpointing on; full: PagedAdamW8bit with the
    # optimizer step in backward.
    _tt("tt-8b-full-4090", "llama-3.1-8b", "Llama 3.1 8B", "full", RTX4090, 1, 1650,
        differences=_TT_README + "; 8-bit paged AdamW, step in backward"),
    _tt("tt-8b-full-a6000", "llama-3.1-8b", "Llama 3.1 8B", "full", A6000, 1, 2579,
        differences=_TT_README + "; 8-bit paged AdamW, step in backward", not_expressible=_A6000_SUSPECT),
    _tt("tt-8b-lora-4090", "llama-3.1-8b", "Llama 3.1 8B", "lora", RTX4090, 1, 3083, differences=_TT_README),
    _tt("tt-8b-lora-a6000", "llama-3.1-8b", "Llama 3.1 8B", "lora", A6000, 1, 4699, differences=_TT_README,
        not_expressible=_A6000_SUSPECT),
    _tt("tt-8b-qlora-4090", "llama-3.1-8b", "Llama 3.1 8B", "qlora", RTX4090, 1, 2413,
        differences=_TT_README + "; torchao NF4 (compiled dequantisation), not bitsandbytes"),
    # 70B/405B on 8 x A100 (80 GB by the 405B row's 44.8 GB peak): FSDP full shard.
    _tt("tt-70b-full-8xa100", "llama-3.1-70b", "Llama 3.1 70B", "full", A100_80, 8, 1568, strategy="fsdp",
        per="run", offload="optimizer+params",
        differences=_TT_README + "; fsdp_cpu_offload (weights, gradients, AdamW on the CPU: fused torch AdamW, "
        "not DeepSpeed CPUAdam); host cores not stated (96 assumed)"),
    _tt("tt-70b-lora-8xa100", "llama-3.1-70b", "Llama 3.1 70B", "lora", A100_80, 8, 3497, strategy="fsdp",
        per="run", rank=16, differences=_TT_README),
    _tt("tt-405b-qlora-8xa100", "llama-3.1-405b", "Llama 3.1 405B", "qlora", A100_80, 8, 653, strategy="fsdp",
        per="run", rank=16, differences=_TT_README + "; torchao NF4; the README's note says batch 2 for every row "
        "(the 405B config itself has batch 1, accumulation 8)"),
    # README "Optimization flags": Llama 3.2 3B, one A100, batch 2, sequence 4096, bf16; each row adds a
    # technique to the previous one (LoRA and QLoRA leave out the step in backward and 8-bit AdamW).
    _tt("tt-3b-full-packed", "llama-3.2-3b", "Llama 3.2 3B", "full", A100_80, 1, 7075, seq=4096, ckpt=False,
        compiled=False, differences=_TT_FLAGS + "; eager"),
    _tt("tt-3b-full-compile", "llama-3.2-3b", "Llama 3.2 3B", "full", A100_80, 1, 8998, seq=4096, ckpt=False,
        differences=_TT_FLAGS + "; torch.compile"),
    _tt("tt-3b-full-chunked-ce", "llama-3.2-3b", "Llama 3.2 3B", "full", A100_80, 1, 9174, seq=4096, ckpt=False,
        differences=_TT_FLAGS + "; torch.compile; chunked cross-entropy"),
    _tt("tt-3b-full-ac", "llama-3.2-3b", "Llama 3.2 3B", "full", A100_80, 1, 7210, seq=4096, ckpt=True,
        differences=_TT_FLAGS + "; torch.compile; chunked cross-entropy"),
    _tt("tt-3b-full-opt-bwd", "llama-3.2-3b", "Llama 3.2 3B", "full", A100_80, 1, 7309, seq=4096, ckpt=True,
        differences=_TT_FLAGS + "; torch.compile; chunked cross-entropy; step in backward"),
    _tt("tt-3b-full-act-offload", "llama-3.2-3b", "Llama 3.2 3B", "full", A100_80, 1, 7301, seq=4096, ckpt=True,
        differences=_TT_FLAGS + "; torch.compile; chunked cross-entropy; step in backward; activation offloading "
        "(its PCIe traffic is costed by planning/search/estimate.py, not by throughput.py)"),
    _tt("tt-3b-full-8bit-adam", "llama-3.2-3b", "Llama 3.2 3B", "full", A100_80, 1, 6960, seq=4096, ckpt=True,
        differences=_TT_FLAGS + "; torch.compile; chunked cross-entropy; step in backward; activation offloading; "
        "8-bit AdamW"),
    _tt("tt-3b-lora", "llama-3.2-3b", "Llama 3.2 3B", "lora", A100_80, 1, 8210, seq=4096, ckpt=True, rank=64,
        differences=_TT_FLAGS + "; torch.compile; chunked cross-entropy; activation offloading"),
    _tt("tt-3b-qlora", "llama-3.2-3b", "Llama 3.2 3B", "qlora", A100_80, 1, 8035, seq=4096, ckpt=True, rank=64,
        differences=_TT_FLAGS + "; torch.compile; chunked cross-entropy; activation offloading; torchao NF4"),
    # The unpacked baseline (2091 tokens/s) pads each sample to the batch's longest: the model counts
    # padded tokens as work, the figure counts only real ones.
    _tt("tt-3b-full-baseline-unpacked", "llama-3.2-3b", "Llama 3.2 3B", "full", A100_80, 1, 2091, seq=4096,
        ckpt=False, differences=_TT_FLAGS, compiled=False,
        not_expressible="unpacked alpaca samples: padding and sample lengths are not published, so the tokens "
        "a step computes on are unknown"),
    # Multinode tutorial: Llama 3.3 70B full on 2 nodes, "roughly seven minutes (880 tok/s)".
    _tt("tt-70b-full-2nodes", "llama-3.1-70b", "Llama 3.3 70B", "full", H100, 8, 880, strategy="fsdp",
        source=TORCHTUNE_MULTINODE, published="880 tok/s", compiled=False,
        not_expressible="GPU type, GPUs per node, batch, sequence length and network are not stated in the "
        "tutorial, nor whether 880 is per GPU"),
]

_AAI = ("bitsandbytes NF4 (QLoRA) through FSDP; rank 64 on all linear layers; dummy data; the epoch's wall "
        "time as logged (includes the first step's warm-up)")
_AAI_3090 = "; 3090s power-limited to 280 W (peak from the 350 W spec), older motherboard with slow PCIe lanes"
_AAI_4090 = "; full PCIe 4 x16 per GPU, 400 W peak draw"


def _aai(key, config, name, method, gpu, gpus, seconds, micro, *, strategy="fsdp", offload="none", context=2048,
         accumulation=1, differences="", split="held-out", published_extra=""):
    rate = _answerai_rate(seconds, gpus, context)
    return Row(
        key=key, source=FSDP_QLORA, model=config, model_name=name, method=method, gpu=gpu, gpus=gpus,
        strategy=strategy, micro_batch=micro, sequence_length=context, gradient_checkpointing=True,
        tokens_per_s=rate, accumulation=accumulation, offload=offload, lora_rank=64, lora_targets=ALL_LINEAR,
        published=f"{seconds:,} s for 1024 x {context} tokens on {gpus} GPUs{published_extra}",
        differences=_AAI + differences, split=split,
    )


ANSWERAI = [
    # Dual 3090 "basement rig", Llama-2 7B, FSDP full shard unless DDP (FSDP NO_SHARD). The prose says
    # "800 seconds vs 550" for the two QLoRA rows the table prints as 1,564 and 1,082: the table is used.
    _aai("aai-3090-7b-qlora-b1-s512", LLAMA2_7B, "Llama-2 7B", "qlora", RTX3090, 2, 1082, 1, context=512,
         differences=_AAI_3090 + "; reentrant checkpointing"),
    _aai("aai-3090-7b-qlora-b1", LLAMA2_7B, "Llama-2 7B", "qlora", RTX3090, 2, 1564, 1,
         differences=_AAI_3090 + "; reentrant checkpointing"),
    _aai("aai-3090-7b-lora-b1-s512", LLAMA2_7B, "Llama-2 7B", "lora", RTX3090, 2, 2597, 1, context=512,
         differences=_AAI_3090),
    _aai("aai-3090-7b-lora-b1", LLAMA2_7B, "Llama-2 7B", "lora", RTX3090, 2, 3090, 1, differences=_AAI_3090),
    _aai("aai-3090-7b-qlora-b4", LLAMA2_7B, "Llama-2 7B", "qlora", RTX3090, 2, 998, 4, differences=_AAI_3090),
    _aai("aai-3090-7b-qlora-b10", LLAMA2_7B, "Llama-2 7B", "qlora", RTX3090, 2, 936, 10, differences=_AAI_3090),
    _aai("aai-3090-7b-lora-b4", LLAMA2_7B, "Llama-2 7B", "lora", RTX3090, 2, 1366, 4, differences=_AAI_3090),
    _aai("aai-3090-7b-lora-b6", LLAMA2_7B, "Llama-2 7B", "lora", RTX3090, 2, 1199, 6, differences=_AAI_3090),
    _aai("aai-3090-7b-qlora-ddp-b8", LLAMA2_7B, "Llama-2 7B", "qlora", RTX3090, 2, 875, 8, strategy="ddp",
         differences=_AAI_3090 + "; FSDP NO_SHARD, not DistributedDataParallel"),
    _aai("aai-3090-7b-lora-ddp-b4", LLAMA2_7B, "Llama-2 7B", "lora", RTX3090, 2, 881, 4, strategy="ddp",
         differences=_AAI_3090 + "; FSDP NO_SHARD, not DistributedDataParallel"),
    _aai("aai-3090-34b-qlora-b2", YI_34B, "Yi 34B", "qlora", RTX3090, 2, 5041, 2, differences=_AAI_3090),
    _aai("aai-3090-34b-qlora-offload-b4", YI_34B, "Yi 34B", "qlora", RTX3090, 2, 4830, 4,
         offload="optimizer+params", differences=_AAI_3090 + "; FSDP CPUOffload (weights on the host)"),
    _aai("aai-3090-70b-qlora-offload-b2", LLAMA2_70B, "Llama-2 70B", "qlora", RTX3090, 2, 11795, 2,
         offload="optimizer+params", differences=_AAI_3090 + "; FSDP CPUOffload; 128 GB host RAM plus swap"),
    # Dual 4090 "budget workstation".
    _aai("aai-4090-7b-lora-ddp-b4", LLAMA2_7B, "Llama-2 7B", "lora", RTX4090, 2, 437, 4, strategy="ddp",
         differences=_AAI_4090 + "; FSDP NO_SHARD"),
    _aai("aai-4090-7b-lora-b6", LLAMA2_7B, "Llama-2 7B", "lora", RTX4090, 2, 481, 6, differences=_AAI_4090),
    _aai("aai-4090-7b-lora-offload-b10", LLAMA2_7B, "Llama-2 7B", "lora", RTX4090, 2, 482, 10,
         offload="optimizer+params", differences=_AAI_4090 + "; FSDP CPUOffload"),
    _aai("aai-4090-7b-qlora-ddp-b8", LLAMA2_7B, "Llama-2 7B", "qlora", RTX4090, 2, 450, 8, strategy="ddp",
         differences=_AAI_4090 + "; FSDP NO_SHARD"),
    _aai("aai-4090-7b-qlora-b10", LLAMA2_7B, "Llama-2 7B", "qlora", RTX4090, 2, 466, 10, differences=_AAI_4090),
    _aai("aai-4090-7b-qlora-offload-b12", LLAMA2_7B, "Llama-2 7B", "qlora", RTX4090, 2, 464, 12,
         offload="optimizer+params", differences=_AAI_4090 + "; FSDP CPUOffload"),
    _aai("aai-4090-34b-qlora-b2", YI_34B, "Yi 34B", "qlora", RTX4090, 2, 2072, 2, differences=_AAI_4090),
    _aai("aai-4090-34b-qlora-offload-b4", YI_34B, "Yi 34B", "qlora", RTX4090, 2, 2061, 4,
         offload="optimizer+params", differences=_AAI_4090 + "; FSDP CPUOffload"),
    _aai("aai-4090-70b-qlora-offload-b2", LLAMA2_70B, "Llama-2 70B", "qlora", RTX4090, 2, 4399, 2,
         offload="optimizer+params", differences=_AAI_4090 + "; FSDP CPUOffload"),
    _aai("aai-4090-mistral-qlora-offload-b12", MISTRAL_7B_V02, "Mistral 7B v0.2", "qlora", RTX4090, 2, 483, 12,
         offload="optimizer+params", differences=_AAI_4090 + "; FSDP CPUOffload",
         published_extra=" (the text: 2,200 tokens/s)"),
    _aai("aai-4090-mistral-qlora-offload-s24k", MISTRAL_7B_V02, "Mistral 7B v0.2", "qlora", RTX4090, 2, 7809, 1,
         context=24576, offload="optimizer+params", differences=_AAI_4090 + "; FSDP CPUOffload",
         published_extra=" (the text: 1,615 tokens/s)"),
    # "Recommendations for different hardware": Llama-2 70B QLoRA, context 2048, effective batch 32
    # "or the closest" (accumulation = 32 / (batch x GPUs), rounded); CPU offload rows also offload
    # activations. Single nodes; A5000 and 6000 Ada nodes over PCIe.
    _aai("aai-70b-2xa5000-offload", LLAMA2_70B, "Llama-2 70B", "qlora", A5000, 2, 9688, 2, accumulation=8,
         offload="optimizer+params", differences="; FSDP CPUOffload and activation offloading"),
    _aai("aai-70b-4xa5000", LLAMA2_70B, "Llama-2 70B", "qlora", A5000, 4, 4829, 1, accumulation=8),
    _aai("aai-70b-8xa5000", LLAMA2_70B, "Llama-2 70B", "qlora", A5000, 8, 2613, 1, accumulation=4),
    _aai("aai-70b-2xa6000ada", LLAMA2_70B, "Llama-2 70B", "qlora", A6000_ADA, 2, 5867, 2, accumulation=8),
    _aai("aai-70b-4xa6000ada", LLAMA2_70B, "Llama-2 70B", "qlora", A6000_ADA, 4, 2904, 3, accumulation=3,
         differences="; effective batch 32 is not a multiple of 4 x 3 (accumulation 3 assumed)"),
    _aai("aai-70b-2xa100-40", LLAMA2_70B, "Llama-2 70B", "qlora", A100_40, 2, 3277, 1, accumulation=16,
         differences="; A100 40GB SXM (NVLink assumed)"),
    _aai("aai-70b-4xa100-40", LLAMA2_70B, "Llama-2 70B", "qlora", A100_40, 4, 1266, 4, accumulation=2,
         differences="; A100 40GB SXM (NVLink assumed)"),
    _aai("aai-70b-8xa100-40", LLAMA2_70B, "Llama-2 70B", "qlora", A100_40, 8, 672, 4, accumulation=1,
         differences="; A100 40GB SXM (NVLink assumed)"),
    _aai("aai-70b-4xh100", LLAMA2_70B, "Llama-2 70B", "qlora", H100, 4, 667, 8, accumulation=1,
         differences="; H100 80GB SXM"),
]

_TITAN = ("pre-training (same FLOPs as full fine-tuning); H100 96 GB HBM2e at a 500 W power limit (the table's "
          "H100-80GB peak at 700 W is used); selective (per-op) activation checkpointing, modelled as none; "
          "sequence 8192 (the 8B train config); 400 Gbit/s RDMA per GPU")

TORCHTITAN_ROWS = [
    Row(key="titan-8b-fsdp-8", source=TORCHTITAN, model="llama-3.1-8b", model_name="Llama 3.1 8B", method="full",
        gpu=H100, gpus=8, strategy="fsdp", micro_batch=2, sequence_length=8192, gradient_checkpointing=False,
        tokens_per_s=5762, published="5,762 TPS/GPU (Table 1, FSDP, eager)", differences=_TITAN + "; eager",
        split="held-out"),
    Row(key="titan-8b-fsdp-compile-8", source=TORCHTITAN, model="llama-3.1-8b", model_name="Llama 3.1 8B",
        method="full", gpu=H100, gpus=8, strategy="fsdp", micro_batch=2, sequence_length=8192,
        gradient_checkpointing=False, tokens_per_s=6667, compiled=True, published="6,667 TPS/GPU (Table 1, + compile)",
        differences=_TITAN + "; torch.compile", split="held-out"),
    Row(key="titan-8b-fsdp-128", source=TORCHTITAN, model="llama-3.1-8b", model_name="Llama 3.1 8B", method="full",
        gpu=H100, gpus=8, nodes=16, strategy="fsdp", micro_batch=2, sequence_length=8192,
        gradient_checkpointing=False, tokens_per_s=5605, published="5,605 TPS/GPU (Table 3, 128 GPUs, eager)",
        differences=_TITAN + "; eager", split="held-out", extra={"inter_node_gbps": 3200}),
    Row(key="titan-8b-fsdp-compile-128", source=TORCHTITAN, model="llama-3.1-8b", model_name="Llama 3.1 8B",
        method="full", gpu=H100, gpus=8, nodes=16, strategy="fsdp", micro_batch=2, sequence_length=8192,
        gradient_checkpointing=False, tokens_per_s=6514, compiled=True,
        published="6,514 TPS/GPU (Table 3, 128 GPUs, + compile)", differences=_TITAN + "; torch.compile",
        split="held-out", extra={"inter_node_gbps": 3200}),
    Row(key="titan-8b-float8-8", source=TORCHTITAN, model="llama-3.1-8b", model_name="Llama 3.1 8B", method="full",
        gpu=H100, gpus=8, strategy="fsdp", micro_batch=2, sequence_length=8192, gradient_checkpointing=False,
        tokens_per_s=8532, compiled=True, published="8,532 TPS/GPU (Table 1, + compile + Float8)", differences=_TITAN,
        split="held-out", not_expressible="Float8 linear layers: the model knows bf16, fp16 and fp32 rates only"),
]

ROWS: list[Row] = TORCHTUNE + ANSWERAI + TORCHTITAN_ROWS

"""Published, measured peak GPU memory of fine-tuning runs: the rows bench/memory_published.py compares the
memory model (operator/finetune_operator/sizing/memory.py, `estimate_memory`) with. One `Row` per printed
figure; numbers only, each with its source (a file pinned to a commit). Nothing else is taken from them.

Units. Every figure is kept in GiB (2^30 bytes). `published` says what the source printed and how it was
converted: torchtune logged its memory stats in GB = 1e9 bytes until 2024-08-15 (torchtune commit d0b89e2,
"Update peak memory stats to be logged in GiB") and in GiB after; the figures of its spring-2024 docs and
README are GB (x 1e9 / 2^30 = x 0.9313). Lit-GPT prints `max_memory_allocated() / 1e9` as "GB" (x 0.9313).
fsdp_qlora prints GiB (`/ 2**30`).

Metric (`metric`), what the figure counts:
- `allocated`: torch.cuda.max_memory_allocated (Lit-GPT's "Memory used": finetune/lora.py at Lit-GPT commit
  8641822, the commit the resource tables name; fsdp_qlora's "peak allocated" note);
- `active`: the caching allocator's active_bytes.all.peak, torchtune's `peak_memory_active`
  (training/memory.py `get_memory_stats`); it equals the allocated peak except for blocks freed while a
  side stream still uses them (activation offloading's copy stream). The README's optimisation-flags
  table names it; its "Memory and training speed" table prints "Peak Memory per GPU" from the same
  `log_memory_stats` call and is read as active too (not stated: unsure);
- `reserved`: torch.cuda.max_memory_reserved (fsdp_qlora's tables: train.py logs `memory/reserved_peak`;
  torchtune's spring-2024 LoRA/QLoRA tutorials: their QLoRA table says "Peak memory reserved", and the
  LoRA tutorial's Q/V rank-8 figure is the same 15.57 GB run);
- `nvidia-smi`: the process's device memory (reserved + CUDA context, cuBLAS workspace, NCCL); no row
  uses it yet.

`split`: decided before any error was printed. "in-sample" would be a row the memory model's constants
were visibly tuned on; none is: the allocator factors come from replayed traces (bench/allocator_replay.py),
the activation terms from traced fake-tensor runs (bench/sizing_truth.py), and the git log names no fit to
a published figure. Every row is "held-out". Eight of them were already printed by bench/recipes.py (issue
13: torchtune's 8B full and five 3B flag rows, fsdp_qlora's 7B QLoRA b1 and 70B offload b2) as a check,
not as a fit.

Left out entirely: the seven rows of fsdp_qlora's dual-4090 tables that print, to the hundredth, the figure
of the dual-3090 row with the same setup (22.04, 21.35, 20.94, 20.97, 23.05, 22.98, 14.92 GiB): read as the
same measurement reprinted, so counting them again would weight those setups twice.

Setup defaults of the sources that every row of a source shares are in its `_DIFF_*` text; `differences`
lists, per row, what the published run does that the memory model cannot be told.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

GB = 1e9 / 2**30  # a figure printed in GB (1e9 bytes), in GiB

TORCHTUNE = "https://github.com/pytorch/torchtune/blob/"
TT_COMMIT = "bd2a0fc7c31430972728494fa01aaeeb0ebf1ba1"
TT_README = f"{TORCHTUNE}{TT_COMMIT}/README.md"
TT_LORA_TUTORIAL = f"{TORCHTUNE}{TT_COMMIT}/docs/source/tutorials/lora_finetune.rst"
TT_QLORA_TUTORIAL = f"{TORCHTUNE}{TT_COMMIT}/docs/source/tutorials/qlora_finetune.rst"
TT_LLAMA3_TUTORIAL = f"{TORCHTUNE}{TT_COMMIT}/docs/source/tutorials/llama3.rst"
# The README's spring-2024 tables (replaced later; the README at the commit that printed them).
TT_README_2024_04 = f"{TORCHTUNE}fef3ed10dc9efe9e35b118e4397e84c680c0a737/README.md"
TT_README_2024_05 = f"{TORCHTUNE}0217d44c2e1e372b34628767745c1f6538086a81/README.md"
FSDP_QLORA = ("https://github.com/AnswerDotAI/fsdp_qlora/blob/05ed9f2a60f96a0795cb082bceab70a9b19fd213/"
              "benchmarks_03_2024.md")
LITGPT = "https://github.com/Lightning-AI/litgpt/blob/26857050fe3ff627cd714fe92f5838f51a3d5efa/tutorials/"
LITGPT_TABLES = LITGPT + "resource-tables.md"
LITGPT_LORA = LITGPT + "finetune_lora.md"
LITGPT_DATASET = LITGPT + "prepare_dataset.md"

METRICS = ("allocated", "active", "reserved", "nvidia-smi")

from published_models import (  # noqa: E402  (bench/ is on the path of whoever imports this)
    LLAMA2_7B, LLAMA2_13B, LLAMA2_70B, MISTRAL_7B_V02, STABLELM_ALPHA_3B, YI_34B)

# LoRA targets as the sources name them, in the operator's module names.
QV = ("q_proj", "v_proj")
QKV = ("q_proj", "k_proj", "v_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
TT_QLORA_7B = ("q_proj", "v_proj", "k_proj", "o_proj") + MLP  # lora_attn_modules q, v, k, output_proj + mlp
TT_3B = ("q_proj", "v_proj", "o_proj") + MLP
TT_ALL_HEAD = QKV + ("o_proj",) + MLP + ("lm_head",)  # apply_lora_to_output: the head too
AAI_ALL = ("k_proj", "q_proj", "v_proj", "up_proj", "down_proj", "gate_proj")  # fsdp_qlora's "all" (no o_proj)


@dataclass(frozen=True)
class Row:
    key: str
    source: str  # URL of the file (pinned commit) the figure is printed in
    model: str | dict[str, Any]  # a preset name, or a config.json mapping
    model_name: str
    method: str  # full, lora, qlora
    gpu: str  # the card, as the source names it
    gpus: int
    strategy: str  # ddp (one GPU, or FSDP NO_SHARD), fsdp (FULL_SHARD), zero1-3
    micro_batch: int
    sequence_length: int  # tokens of the longest row of a micro-batch
    gradient_checkpointing: bool
    published_gib: float  # the figure, in GiB
    published: str  # the figure as printed, and the conversion
    metric: str  # METRICS
    differences: str  # what the published setup does that the memory model does not know about
    split: str = "held-out"
    not_expressible: str | None = None  # why the model cannot be asked about this setup at all
    precision: str = "bf16"
    optimizer: str = "adamw"
    lora_rank: int = 8
    lora_targets: str | tuple[str, ...] = "all-linear"
    lora_dropout: float = 0.0
    offload: str = "none"
    accumulation: int = 1
    fixed_lengths: bool = False  # every micro-batch the same length (packed or fixed-length dummy data)
    expandable_segments: bool = False  # PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True in the run
    compiled: bool = False  # torch.compile on (the operator's trainer runs eager)
    levers: dict = field(default_factory=dict)  # TrainingSetup fields beyond the above (levers, adamw path)


# ---- torchtune ---------------------------------------------------------------------------------------

_TT = ("torchtune's own model code (not transformers) with logits upcast to fp32 in the model; LoRA adapters and "
       "their AdamW states in bf16 (the model sizes fp32 adapters with autocast copies)")
_TT_QLORA = ("torchao NF4 on the adapted linears only, with the embedding, norms and head in bf16 (the model sizes "
             "peft's prepare_model_for_kbit_training: those in fp32, and an fp32 residual stream on one GPU)")
_TT_SPEED = ("README note: batch 2, no accumulation, packed to 2048, torch.compile on (the model is eager); "
             "configs read at torchtune 30b8519 (the commit that added the table); packed rows attend through "
             "flex attention's block mask, modelled as unmasked rows; " + _TT)
_TT_FLAGS = ("README flags table: Llama 3.2 3B, one A100 (80 GB: a 60 GiB peak), batch 2, packed to 4096, "
             "full_finetune_single_device in bf16 (bf16 weights, gradients and AdamW states); each row adds its "
             "technique to the one above; " + _TT)
_TT_SPRING = ("alpaca_cleaned, unpacked, cut at alpaca's default max_seq_len 512 and padded to the batch's longest "
              "(modelled as 512-token rows: over a logging window some batch reaches it); PyTorch's default "
              "allocator (torchtune set expandable segments only from 2025-06); " + _TT)
_CAP24 = "; a 24 GB card: the reserved peak may be held down by the card (the allocator frees its cache and retries)"


def _tt(key, model, name, method, gpu, gpus, gib, published, metric, *, source=TT_README, strategy="ddp", seq=2048,
        micro=2, ckpt=True, rank=8, targets="all-linear", optimizer="adamw", offload="none", fixed=True,
        compiled=True, differences="", not_expressible=None, **levers):
    return Row(key=key, source=source, model=model, model_name=name, method=method, gpu=gpu, gpus=gpus,
               strategy=strategy, micro_batch=micro, sequence_length=seq, gradient_checkpointing=ckpt,
               published_gib=gib, published=published, metric=metric, differences=differences,
               not_expressible=not_expressible, optimizer=optimizer, lora_rank=rank,
               lora_targets=targets if method != "full" else "all-linear", offload=offload, fixed_lengths=fixed,
               compiled=compiled, levers=levers)


_A6000 = ("the RTX A6000 row of the same recipe prints about twice the RTX 4090 row's peak: batch, checkpointing or "
          "optimizer must differ from the README note, and which is not stated")
_FULL_BF16 = dict(master_weights="bf16")

TORCHTUNE_ROWS = [
    # README "Memory and training speed" (Llama 3.1; added at 30b8519, 2024-09-24; logged in GiB by then).
    _tt("tt-8b-full-4090", "llama-3.1-8b", "Llama 3.1 8B", "full", "RTX 4090", 1, 18.9, "18.9 GiB", "active",
        optimizer="paged-adamw-8bit", optimizer_in_backward=True, loss_chunks=8, **_FULL_BF16,
        differences=_TT_SPEED + "; 8B_full_single_device: bnb PagedAdamW8bit (its states in unified memory, outside "
        "the metric), optimizer step in backward, CEWithChunkedOutputLoss (8 chunks, the bf16 chunks kept for "
        "backward)"),
    _tt("tt-8b-full-a6000", "llama-3.1-8b", "Llama 3.1 8B", "full", "RTX A6000", 1, 37.4, "37.4 GiB", "active",
        optimizer="paged-adamw-8bit", optimizer_in_backward=True, loss_chunks=8, **_FULL_BF16,
        differences=_TT_SPEED, not_expressible=_A6000),
    _tt("tt-8b-lora-4090", "llama-3.1-8b", "Llama 3.1 8B", "lora", "RTX 4090", 1, 16.2, "16.2 GiB", "active",
        targets=QV, loss_chunks=8, differences=_TT_SPEED + "; 8B_lora_single_device: rank 8 on q, v; chunked CE"),
    _tt("tt-8b-lora-a6000", "llama-3.1-8b", "Llama 3.1 8B", "lora", "RTX A6000", 1, 30.3, "30.3 GiB", "active",
        targets=QV, loss_chunks=8, differences=_TT_SPEED, not_expressible=_A6000),
    _tt("tt-8b-qlora-4090", "llama-3.1-8b", "Llama 3.1 8B", "qlora", "RTX 4090", 1, 7.4, "7.4 GiB", "active",
        targets=TT_QLORA_7B, loss_chunks=8,
        differences=_TT_SPEED + "; 8B_qlora_single_device: rank 8 on q, k, v, output and the MLP; " + _TT_QLORA),
    _tt("tt-70b-full-8xa100", "llama-3.1-70b", "Llama 3.1 70B", "full", "A100 80GB", 8, 13.9, "13.9 GiB **",
        "active", strategy="fsdp", offload="optimizer+params", loss_chunks=8, **_FULL_BF16,
        differences=_TT_SPEED + "; 70B_full: FSDP2 with fsdp_cpu_offload (weights, gradients and fused AdamW on the "
        "CPU), bf16 weights; the A100's memory size is not stated"),
    _tt("tt-70b-lora-8xa100", "llama-3.1-70b", "Llama 3.1 70B", "lora", "A100 80GB", 8, 27.6, "27.6 GiB", "active",
        strategy="fsdp", rank=16, targets=QKV, loss_chunks=8,
        differences=_TT_SPEED + "; 70B_lora: FSDP2, rank 16 on q, k, v"),
    _tt("tt-405b-qlora-8xa100", "llama-3.1-405b", "Llama 3.1 405B", "qlora", "A100 80GB", 8, 44.8,
        "44.8 GB, read as GiB (every other figure of the table is GiB, and torchtune logged GiB when it was added)",
        "active", strategy="fsdp", rank=16, targets=TT_QLORA_7B,
        differences=_TT_SPEED + "; 405B_qlora: FSDP2 over torchao NF4, rank 16 on q, k, v, output and the MLP, plain "
        "CrossEntropyLoss; the config's batch is 1 with accumulation 16, the note says batch 2 (used)"),
    # README "Optimization flags" (added at 1814feb, 2024-11-18): peak memory active, GiB.
    _tt("tt-3b-baseline-unpacked", "llama-3.2-3b", "Llama 3.2 3B", "full", "A100", 1, 25.5, "25.5 GiB", "active",
        seq=4096, ckpt=False, fixed=False, compiled=False, **_FULL_BF16, differences=_TT_FLAGS,
        not_expressible="unpacked alpaca_cleaned with max_seq_len 4096: the longest batch of the run (which sets "
        "the peak) is not published"),
    _tt("tt-3b-packed", "llama-3.2-3b", "Llama 3.2 3B", "full", "A100", 1, 60.0, "60.0 GiB", "active", seq=4096,
        ckpt=False, compiled=False, **_FULL_BF16, differences=_TT_FLAGS + "; eager; plain CrossEntropyLoss"),
    _tt("tt-3b-compile", "llama-3.2-3b", "Llama 3.2 3B", "full", "A100", 1, 51.0, "51.0 GiB", "active", seq=4096,
        ckpt=False, **_FULL_BF16, differences=_TT_FLAGS + "; torch.compile (fuses element-wise ops: fewer saved "
        "activations than eager)"),
    _tt("tt-3b-chunked-ce", "llama-3.2-3b", "Llama 3.2 3B", "full", "A100", 1, 42.9, "42.9 GiB", "active", seq=4096,
        ckpt=False, loss_chunks=8, **_FULL_BF16,
        differences=_TT_FLAGS + "; torch.compile; CEWithChunkedOutputLoss (keeps the bf16 logit chunks; the model's "
        "chunked loss recomputes them)"),
    _tt("tt-3b-ac", "llama-3.2-3b", "Llama 3.2 3B", "full", "A100", 1, 24.9, "24.9 GiB", "active", seq=4096,
        loss_chunks=8, **_FULL_BF16, differences=_TT_FLAGS + "; torch.compile; chunked CE"),
    _tt("tt-3b-opt-bwd", "llama-3.2-3b", "Llama 3.2 3B", "full", "A100", 1, 23.1, "23.1 GiB", "active", seq=4096,
        loss_chunks=8, optimizer_in_backward=True, **_FULL_BF16,
        differences=_TT_FLAGS + "; torch.compile; chunked CE; step in backward"),
    _tt("tt-3b-act-offload", "llama-3.2-3b", "Llama 3.2 3B", "full", "A100", 1, 21.8, "21.8 GiB", "active",
        seq=4096, loss_chunks=8, optimizer_in_backward=True, activation_offloading=True, **_FULL_BF16,
        differences=_TT_FLAGS + "; torch.compile; chunked CE; step in backward; activation offloading (its copy "
        "stream keeps blocks active after their free)"),
    _tt("tt-3b-8bit-adam", "llama-3.2-3b", "Llama 3.2 3B", "full", "A100", 1, 17.6, "17.6 GiB", "active", seq=4096,
        optimizer="torchao-adamw-8bit", loss_chunks=8, optimizer_in_backward=True, activation_offloading=True,
        **_FULL_BF16, differences=_TT_FLAGS + "; torch.compile; chunked CE; step in backward; activation "
        "offloading; 'AdamW8bit' read as torchao's low_bit_optim.AdamW8bit (the linked docs name it; bnb's "
        "AdamW8bit is possible)"),
    _tt("tt-3b-lora", "llama-3.2-3b", "Llama 3.2 3B", "lora", "A100", 1, 8.5, "8.5 GiB", "active", seq=4096,
        rank=64, targets=TT_3B, loss_chunks=8, activation_offloading=True,
        differences=_TT_FLAGS + "; 3B_lora_single_device: rank 64 on q, v, output and the MLP; torch.compile; "
        "chunked CE; activation offloading; AdamW"),
    _tt("tt-3b-qlora", "llama-3.2-3b", "Llama 3.2 3B", "qlora", "A100", 1, 4.6, "4.6 GiB", "active", seq=4096,
        rank=64, targets=TT_3B, loss_chunks=8, activation_offloading=True,
        differences=_TT_FLAGS + "; 3B_qlora_single_device (the README's command): rank 64 on q, v, output and the "
        "MLP (k_proj stays bf16, unquantised); torch.compile; chunked CE; activation offloading; " + _TT_QLORA),
    # README of 2024-04-16 (fef3ed1): "Peak Memory per GPU" of the default configs, GB; the QLoRA figure is
    # the QLoRA tutorial's "peak memory reserved, training" (9.29 GB): read as reserved.
    _tt("tt24-7b-qlora-4090", LLAMA2_7B, "Llama-2 7B", "qlora", "RTX 4090", 1, 9.29 * GB,
        "9.29 GB (x 0.9313; also the QLoRA tutorial's reserved training peak)", "reserved", source=TT_README_2024_04,
        seq=512, targets=TT_QLORA_7B, fixed=False, compiled=False,
        differences="7B_qlora_single_device: rank 8 on q, v, k, output and the MLP; " + _TT_SPRING + "; " + _TT_QLORA
        + _CAP24),
    _tt("tt24-7b-lora-2x4090", LLAMA2_7B, "Llama-2 7B", "lora", "RTX 4090", 2, 20.95 * GB, "20.95 GB (x 0.9313)",
        "reserved", source=TT_README_2024_04, strategy="fsdp", seq=512, ckpt=False, targets=QV, fixed=False,
        compiled=False, differences="7B_lora (lora_finetune_distributed, FSDP1 full shard): rank 8 on q, v, no "
        "activation checkpointing; " + _TT_SPRING + _CAP24),
    _tt("tt24-7b-lora-4090", LLAMA2_7B, "Llama-2 7B", "lora", "RTX 4090", 1, 17.18 * GB, "17.18 GB (x 0.9313)",
        "reserved", source=TT_README_2024_04, seq=512, targets=QV, fixed=False, compiled=False,
        differences="7B_lora_single_device: rank 8 on q, v; " + _TT_SPRING + "; the LoRA tutorial prints 15.57 GB "
        "for what reads as the same config (two measurements disagree by 10%)"),
    _tt("tt24-7b-full-lowmem-4090", LLAMA2_7B, "Llama-2 7B", "full", "RTX 4090", 1, 14.97 * GB,
        "14.97 GB (x 0.9313)", "reserved", source=TT_README_2024_04, seq=512, optimizer="paged-adamw-8bit",
        fixed=False, compiled=False, optimizer_in_backward=True, **_FULL_BF16,
        differences="7B_full_low_memory: bnb PagedAdamW (32-bit states, paged: in unified memory, outside the metric "
        "as the model's paged 8-bit states are; sized as paged-adamw-8bit), step in backward, bf16 weights; "
        + _TT_SPRING),
    _tt("tt24-7b-full-4x4090", LLAMA2_7B, "Llama-2 7B", "full", "RTX 4090", 4, 22.9 * GB, "22.9 GB (x 0.9313)",
        "reserved", source=TT_README_2024_04, strategy="fsdp", seq=512, fixed=False, compiled=False, **_FULL_BF16,
        differences="7B_full (full_finetune_distributed, FSDP1 full shard): bf16 weights and AdamW states; "
        + _TT_SPRING + _CAP24),
    # LoRA tutorial (written 2024-04, GB): Llama-2 7B, 7B_lora_single_device, batch 2, checkpointing on.
    _tt("tt-lora-tut-qv-r8", LLAMA2_7B, "Llama-2 7B", "lora", "unstated", 1, 15.57 * GB,
        "15.57 GB (x 0.9313; the QLoRA tutorial's LoRA 'peak memory reserved, training')", "reserved",
        source=TT_LORA_TUTORIAL, seq=512, targets=QV, fixed=False, compiled=False,
        differences="rank 8 on q, v; " + _TT_SPRING),
    _tt("tt-lora-tut-all-r8", LLAMA2_7B, "Llama-2 7B", "lora", "unstated", 1, 15.87 * GB, "15.87 GB (x 0.9313)",
        "reserved", source=TT_LORA_TUTORIAL, seq=512, targets=TT_ALL_HEAD, fixed=False, compiled=False,
        differences="rank 8 on q, k, v, output, the MLP and the output head; " + _TT_SPRING),
    _tt("tt-lora-tut-qv-r64", LLAMA2_7B, "Llama-2 7B", "lora", "unstated", 1, 15.86 * GB, "15.86 GB (x 0.9313)",
        "reserved", source=TT_LORA_TUTORIAL, seq=512, rank=64, targets=QV, fixed=False, compiled=False,
        differences="rank 64 on q, v; " + _TT_SPRING),
    _tt("tt-lora-tut-all-r64", LLAMA2_7B, "Llama-2 7B", "lora", "unstated", 1, 17.04 * GB, "17.04 GB (x 0.9313)",
        "reserved", source=TT_LORA_TUTORIAL, seq=512, rank=64, targets=TT_ALL_HEAD, fixed=False, compiled=False,
        differences="rank 64 on q, k, v, output, the MLP and the output head; " + _TT_SPRING),
    # Llama 3 tutorial (2024-04): "a peak memory usage of 18.5 GB", metric not named.
    _tt("tt-llama3-tut-8b-lora", "llama-3.1-8b", "Llama 3 8B", "lora", "unstated", 1, 18.5 * GB,
        "18.5 GB (x 0.9313); metric not named: read as reserved, as the LoRA and QLoRA tutorials of the same "
        "weeks compared", "reserved", source=TT_LLAMA3_TUTORIAL, seq=512, targets=QV, fixed=False, compiled=False,
        differences="llama3/8B_lora_single_device: rank 8 on q, v, plain CE; Llama 3 8B sized with the Llama 3.1 8B "
        "preset (same shapes); the metric is a guess; " + _TT_SPRING),
]

# README of 2024-05-09 (0217d44): "Batch Size = 4, Seq Length = 2048", GB. Neither the data (packed or
# alpaca cut at 2048, whose examples are far shorter) nor the metric is stated.
_TT_MAY = ("the table names batch 4 and 'Seq Length 2048' but not the data: packed to 2048 or alpaca cut at 2048 "
           "(its examples are far shorter) give very different activations; nor does it name the metric")
for _key, _gpus, _method, _model, _name, _gib, _seq, _strategy in (
        ("tt-may24-7b-qlora-4090", 1, "qlora", LLAMA2_7B, "Llama-2 7B", 12.3, 2048, "ddp"),
        ("tt-may24-7b-lora-4090", 1, "lora", LLAMA2_7B, "Llama-2 7B", 21.3, 2048, "ddp"),
        ("tt-may24-7b-lora-2x4090", 2, "lora", LLAMA2_7B, "Llama-2 7B", 16.2, 2048, "fsdp"),
        ("tt-may24-7b-full-4090", 1, "full", LLAMA2_7B, "Llama-2 7B", 24.1, 2048, "ddp"),
        ("tt-may24-7b-full-4x4090", 4, "full", LLAMA2_7B, "Llama-2 7B", 24.1, 2048, "fsdp"),
        ("tt-may24-70b-lora-8xa100", 8, "lora", LLAMA2_70B, "Llama-2 70B", 26.4, 4096, "fsdp"),
        ("tt-may24-70b-full-8xa100", 8, "full", LLAMA2_70B, "Llama-2 70B", 70.4, 4096, "fsdp")):
    TORCHTUNE_ROWS.append(_tt(
        _key, _model, _name, _method, "A100" if "a100" in _key else "RTX 4090", _gpus, _gib * GB,
        f"{_gib} GB (x 0.9313)", "reserved", source=TT_README_2024_05, strategy=_strategy, seq=_seq, micro=4,
        targets=QV, fixed=False, compiled="qlora" in _key, differences="", not_expressible=_TT_MAY))


# ---- Answer.AI fsdp_qlora ----------------------------------------------------------------------------------

_AAI = ("fsdp_qlora train.py, dummy data (every sample cut to the full context: fixed lengths), default precision "
        "'bf16': the whole model, the LoRA adapters and their AdamW states in bf16 (the model sizes fp32 adapters); "
        "torch AdamW's default (foreach) path; rank 64 on q, k, v, gate, up, down (fsdp_qlora's 'all'); LoRA "
        "dropout 0.1; FSDP1 with backward prefetch; the peak is max_memory_reserved of rank 0 over the first "
        "epoch; PyTorch's default allocator (train.py sets no expandable segments); the benchmarks ran in Feb-Mar "
        "2024, the code is read at the pinned commit")
_REENTRANT = "; reentrant activation checkpointing"
_OFF = "; FSDP CPUOffload (sharded weights, gradients and the AdamW step on the host)"


def _aai(key, config, name, method, gpu, gib, micro, *, seq=2048, strategy="fsdp", offload="none",
         metric="reserved", published=None, differences=""):
    return Row(key=key, source=FSDP_QLORA, model=config, model_name=name, method=method, gpu=gpu, gpus=2,
               strategy=strategy, micro_batch=micro, sequence_length=seq, gradient_checkpointing=True,
               published_gib=gib, published=published or f"{gib} GiB", metric=metric,
               differences=_AAI + differences, optimizer="adamw", lora_rank=64, lora_targets=AAI_ALL,
               lora_dropout=0.1, offload=offload, fixed_lengths=True, levers={"adamw_implementation": "foreach"})


_3090 = "RTX 3090"
_4090 = "RTX 4090"
ANSWERAI_ROWS = [
    _aai("aai-3090-7b-qlora-b1-s512", LLAMA2_7B, "Llama-2 7B", "qlora", _3090, 4.98, 1, seq=512,
         differences=_REENTRANT),
    _aai("aai-3090-7b-qlora-b1", LLAMA2_7B, "Llama-2 7B", "qlora", _3090, 5.21, 1, differences=_REENTRANT),
    _aai("aai-3090-7b-lora-b1-s512", LLAMA2_7B, "Llama-2 7B", "lora", _3090, 10.24, 1, seq=512),
    _aai("aai-3090-7b-lora-b1", LLAMA2_7B, "Llama-2 7B", "lora", _3090, 10.22, 1),
    _aai("aai-3090-7b-lora-b1-s512-alloc", LLAMA2_7B, "Llama-2 7B", "lora", _3090, 8.28, 1, seq=512,
         metric="allocated", published="8.28 GiB (the note under the LoRA table: peak allocated)"),
    _aai("aai-3090-7b-lora-b1-alloc", LLAMA2_7B, "Llama-2 7B", "lora", _3090, 9.16, 1, metric="allocated",
         published="9.16 GiB (the note under the LoRA table: peak allocated)"),
    _aai("aai-3090-7b-qlora-b4", LLAMA2_7B, "Llama-2 7B", "qlora", _3090, 11.22, 4),
    _aai("aai-3090-7b-qlora-b10", LLAMA2_7B, "Llama-2 7B", "qlora", _3090, 20.97, 10, differences=_CAP24),
    _aai("aai-3090-7b-lora-b4", LLAMA2_7B, "Llama-2 7B", "lora", _3090, 16.14, 4),
    _aai("aai-3090-7b-lora-b6", LLAMA2_7B, "Llama-2 7B", "lora", _3090, 21.35, 6, differences=_CAP24),
    _aai("aai-3090-7b-qlora-ddp-b8", LLAMA2_7B, "Llama-2 7B", "qlora", _3090, 20.94, 8, strategy="ddp",
         differences="; FSDP NO_SHARD (not DistributedDataParallel): the base stays in bf16 outside the 4-bit "
         "layers, unlike peft's fp32 cast the model sizes for qlora on ddp" + _CAP24),
    _aai("aai-3090-7b-lora-ddp-b4", LLAMA2_7B, "Llama-2 7B", "lora", _3090, 22.04, 4, strategy="ddp",
         differences="; FSDP NO_SHARD (not DistributedDataParallel)" + _CAP24),
    _aai("aai-3090-34b-qlora-b2", YI_34B, "Yi 34B", "qlora", _3090, 23.05, 2, differences=_CAP24),
    _aai("aai-3090-34b-qlora-offload-b4", YI_34B, "Yi 34B", "qlora", _3090, 22.98, 4, offload="optimizer+params",
         differences=_OFF + _CAP24),
    _aai("aai-3090-70b-qlora-offload-b2", LLAMA2_70B, "Llama-2 70B", "qlora", _3090, 14.92, 2,
         offload="optimizer+params", differences=_OFF),
    _aai("aai-4090-7b-lora-offload-b10", LLAMA2_7B, "Llama-2 7B", "lora", _4090, 22.69, 10,
         offload="optimizer+params", differences=_OFF + _CAP24),
    _aai("aai-4090-7b-qlora-offload-b12", LLAMA2_7B, "Llama-2 7B", "qlora", _4090, 22.38, 12,
         offload="optimizer+params", differences=_OFF + _CAP24),
    _aai("aai-4090-mistral-qlora-offload-b12", MISTRAL_7B_V02, "Mistral 7B v0.2", "qlora", _4090, 22.54, 12,
         offload="optimizer+params", differences=_OFF + _CAP24),
    _aai("aai-4090-mistral-qlora-offload-s24k", MISTRAL_7B_V02, "Mistral 7B v0.2", "qlora", _4090, 22.54, 1,
         seq=24576, offload="optimizer+params", differences=_OFF + _CAP24),
]


# ---- Lit-GPT ------------------------------------------------------------------------------------------------

_LIT = ("Lit-GPT (commit 8641822, 2023-10; PyTorch 2.1) finetune/lora.py: its own model code; --precision bf16-true "
        "(every weight, the adapters and their AdamW states in bf16: the model sizes fp32 adapters); rank 8 on the "
        "query and value (Lit-GPT's fused qkv for GPT-NeoX: sized as LoRA on query_key_value, the same adapter size), "
        "dropout 0.05; logits computed in 128-token chunks of the head, all kept in bf16 for backward (chunked "
        "cross-entropy upcasts one at a time; the model sizes an fp32 upcast of all logits); the first step runs "
        "the longest alpaca example padded into every row of the micro-batch; 'Memory used' is "
        "max_memory_allocated / 1e9 after training")
_LIT_NF4 = ("; bnb.nf4 through Lightning's BitsandbytesPrecision: every linear layer 4-bit, the output head too, "
            "without double quantisation (the model sizes peft's QLoRA: double-quantised blocks, head, "
            "embedding and norms in fp32, an fp32 residual stream); bnb PagedAdamW on the adapters")
_LIT_DQ = _LIT_NF4.replace("without double quantisation", "with double quantisation")
_LIT_FSDP = ("; Lightning Fabric FSDP (FULL_SHARD, one unit per block, activation checkpointing per block, "
             "limit_all_gathers); the peak of rank 0; max_memory_allocated is never reset, so the figure also covers "
             "loading the checkpoint, which Fabric's load_raw does under FSDP1's FULL_STATE_DICT context (every "
             "unit unsharded on every rank while the state dict loads): the figures sit near the single-GPU ones and "
             "barely move with the batch: that loading peak (see _LIT_FSDP_LOAD)")
_LIT_LAYOUT = ("; the model sizes transformers' phi / gpt_neox under autocast (LayerNorm outputs in fp32 and, phi, "
               "gelu_new as a Python formula that saves fp32 intermediates of the MLP width); Lit-GPT's bf16-true has "
               "no autocast, bf16 LayerNorm outputs and one fused tanh GELU")
# Left out after their errors were seen (-21% to -76%), on what the code shows, not on the errors:
# finetune/lora.py at 8641822 builds the model under init_module(empty_init=devices > 1), wraps it in
# FSDP, then load_checkpoint (lit_gpt/utils.py) calls fabric.load_raw for an FSDPStrategy, which loads
# the full state dict with every unit unsharded, and prints max_memory_allocated after training with
# no reset_peak_memory_stats in between. The figure is that load's peak, a phase the operator's
# trainer does not have (from_pretrained loads before FSDP wraps), not a training step's.
_LIT_FSDP_LOAD = ("the printed peak counts Fabric's load_raw of the full checkpoint with every FSDP unit unsharded "
                  "on every rank (finetune/lora.py and lit_gpt/utils.py load_checkpoint at 8641822; the counter is "
                  "never reset before 'Memory used'), not a training step")
_LONGEST = {"phi-1_5": 1044, "stablelm": 1034, "llama2": 1304}  # the tables' longest alpaca example per tokenizer


def _lit(key, model, name, longest, method, gib, micro, gpus=1, *, differences="", source=LITGPT_TABLES,
         targets=QV, not_expressible=None):
    fsdp = gpus > 1
    return Row(key=key, source=source, model=model, model_name=name, method=method, gpu="A100 40GB SXM", gpus=gpus,
               strategy="fsdp" if fsdp else "ddp", micro_batch=micro, sequence_length=longest,
               gradient_checkpointing=fsdp, published_gib=gib * GB, published=f"{gib} GB (x 0.9313)",
               metric="allocated", differences=_LIT + (_LIT_FSDP if fsdp else "") + differences,
               lora_rank=8, lora_targets=targets, lora_dropout=0.05, fixed_lengths=True,
               levers={"adamw_implementation": "foreach"} if method == "lora" else {},
               not_expressible=not_expressible)


_PHI = ("phi-1_5", "phi-1.5", _LONGEST["phi-1_5"])
_SLM = (STABLELM_ALPHA_3B, "StableLM-α 3B", _LONGEST["stablelm"])
_L7 = (LLAMA2_7B, "Llama-2 7B", _LONGEST["llama2"])
_L13 = (LLAMA2_13B, "Llama-2 13B", _LONGEST["llama2"])

LITGPT_ROWS = []
for _tag, (_model, _name, _longest), _targets, _figures in (
        ("phi15", _PHI, QV, {("lora", 1): 4.82, ("nf4", 1): 3.78, ("nf4-dq", 1): 3.72, ("lora", 2): 6.76,
                             ("lora", 4): 10.68}),
        ("stablelm3b", _SLM, ("query_key_value",), {("lora", 1): 9.69, ("nf4", 1): 6.35, ("nf4-dq", 1): 6.19,
                                                    ("lora", 2): 12.10, ("lora", 4): 16.92}),
        ("llama2-7b", _L7, QV, {("lora", 1): 21.30, ("nf4", 1): 14.14, ("nf4-dq", 1): 13.84, ("lora", 2): 29.07}),
        ("llama2-13b", _L13, QV, {("lora", 1): 38.12, ("nf4", 1): 23.14, ("nf4-dq", 1): 22.55})):
    for (_kind, _micro), _gib in _figures.items():
        LITGPT_ROWS.append(_lit(
            f"lit-{_tag}-{_kind}-b{_micro}", _model, _name, _longest, "lora" if _kind == "lora" else "qlora", _gib,
            _micro, targets=_targets, differences={"lora": "", "nf4": _LIT_NF4, "nf4-dq": _LIT_DQ}[_kind]
            + (_LIT_LAYOUT if _tag in ("phi15", "stablelm3b") else "")))
for _tag, (_model, _name, _longest), _targets, _gpus, _figures in (
        ("phi15", _PHI, QV, 2, {1: 4.86, 2: 5.05, 4: 5.88}),
        ("stablelm3b", _SLM, ("query_key_value",), 2, {1: 12.75, 2: 12.94, 4: 13.45}),
        ("llama2-7b", _L7, QV, 2, {1: 22.18, 2: 22.47, 4: 23.39}),
        ("llama2-13b", _L13, QV, 4, {1: 35.57})):
    for _micro, _gib in _figures.items():
        LITGPT_ROWS.append(_lit(f"lit-{_tag}-lora-{_gpus}gpu-b{_micro}", _model, _name, _longest, "lora", _gib,
                                _micro, _gpus, targets=_targets,
                                differences=_LIT_LAYOUT if _tag in ("phi15", "stablelm3b") else "",
                                not_expressible=_LIT_FSDP_LOAD))
# LLaMA-Adapter (v1, v2) rows of the same tables: a method the model does not size.
for _tag, (_model, _name, _longest), _figures in (
        ("stablelm3b", _SLM, {"adapter": (9.10, 5.65, 5.48), "adapter-v2": (10.71, 7.41, 7.25)}),
        ("llama2-7b", _L7, {"adapter": (19.98, 12.68, 12.38), "adapter-v2": (25.51, 18.30, 17.98)})):
    for _method, _values in _figures.items():
        for _quant, _gib in zip(("none", "nf4", "nf4-dq"), _values):
            LITGPT_ROWS.append(_lit(
                f"lit-{_tag}-{_method}-{_quant}-b1", _model, _name, _longest, "lora" if _quant == "none" else "qlora",
                _gib, 1, not_expressible=f"LLaMA-Adapter{' v2' if _method == 'adapter-v2' else ''} (learned prompts "
                "gated into attention): not a method the model sizes"))
LITGPT_ROWS += [
    _lit("lit-stablelm3b-lora-bf16-mixed-b1", *_SLM, "lora", 26.92, 1, source=LITGPT_LORA, targets=("query_key_value",),
         not_expressible="--precision bf16-mixed with LoRA: an fp32 frozen base under autocast, which the model does "
         "not size for lora (its lora base is in the compute dtype)"),
    _lit("lit-falcon7b-lora-b1", "falcon", "Falcon 7B", 1079, "lora", 23.52, 1, source=LITGPT_DATASET,
         not_expressible="Falcon (multi-query attention, parallel block) is not a family the model knows"),
    _lit("lit-falcon7b-lora-b1-s256", "falcon", "Falcon 7B", 256, "lora", 15.73, 1, source=LITGPT_DATASET,
         not_expressible="Falcon (multi-query attention, parallel block) is not a family the model knows"),
]

ROWS: list[Row] = TORCHTUNE_ROWS + ANSWERAI_ROWS + LITGPT_ROWS

"""How long a training step takes on a pool, and so what a run costs. A documented model, not a measurement.

Compute
  FLOPs per token (Kaplan et al. 2020; Chinchilla's 6N rule):
    full:   6 x N   (forward 2N, backward 4N: gradients of activations and of weights)
    lora:   4 x N + 6 x N_adapter   (the frozen base needs activation gradients (2N) but no
            weight gradients (2N saved); the adapters are trained fully)
    qlora:  as lora; the 4-bit base is dequantised on the fly (see below).
  N counts the parameters whose matmuls a token passes through: for a mixture of experts only
  the experts it is routed to, and not an untied input embedding (a lookup, no matmul; Kaplan's
  N leaves embeddings out too). Attention adds 6 x layers x seq x q_width per token for full
  fine-tuning (4 x ... for LoRA; causal masking halves the 12 of a full score matrix).
  Gradient checkpointing recomputes the forward pass: + 2N per token, which is +1/3 of
  full fine-tuning's compute and +1/2 of LoRA's (whose backward is cheaper).
  Achieved throughput = peak dense tensor FLOP/s x utilisation (`STRATEGY_MFU`, of each
  strategy in an eager run, from published runs: bench/throughput_published.py compares the
  model with them; one figure for every GPU generation, which over-predicts H100s, whose
  bandwidth grew less than their FLOP/s) x a micro-batch factor
  tokens / (tokens + `MICRO_BATCH_HALF_TOKENS`) (small micro-batches leave the GPU idle
  between kernels). fp32 runs on TF32 tensor cores at half the bf16 rate.
  QLoRA dequantises each 4-bit weight to bf16 every time a pass uses it (forward, backward,
  recompute): a memory-bound cost per weight and pass, not per token, so it is amortised over
  the micro-batch like the idle time above: a factor tokens / (tokens + `QLORA_DEQUANT_TOKENS`).
Communication (per optimizer step, bytes each GPU moves, ring collectives)
  ddp, zero1, zero2: one all-reduce (or reduce-scatter + all-gather) of the trainable
      gradients: 2 x G bytes.
  fsdp, zero3: per micro-step, an all-gather of the (frozen or trained) weights in forward
      and again in backward (and once more when checkpointing recomputes), plus a
      reduce-scatter of the trainable gradients: (2 + ckpt) x P + G bytes.
  Within a node the traffic runs over NVLink or PCIe (`INTRA_NODE_GBYTES`); across nodes
  the hierarchical collectives move (nodes-1)/nodes of it over each node's network link
  (the pool's `interNodeGbps`, of which a job gets the share of the GPUs it uses per node). Half of the compute time hides communication
  (`COMM_OVERLAP`); the rest is exposed.
Offload (DeepSpeed ZeRO-Offload / ZeRO-Infinity, FSDP CPUOffload)
  optimizer: each optimizer step moves the rank's shard of the trainable gradients to the
      host and the updated weights back over PCIe (`PCIE_GBYTES` per GPU), and the CPU runs
      Adam on the rank's shard with the pod's share of the node's cores
      (`CPU_ADAM_PARAMS_PER_CORE_SECOND`, bound by the node's DRAM bandwidth). The CPU step
      does not overlap with the GPU.
  optimizer+params: in addition, every micro-step streams the rank's shard of the weights
      from the host for each all-gather (forward, backward, and the recompute) and its
      gradient shard back.
  Transfers overlap with compute like communication does.
Cost = steps x seconds per step x GPUs / 3600 x price per GPU-hour.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..sizing import ModelArchitecture
from .pools import NodePool

# Utilisation of an eager (not torch.compile'd) run. ddp: torchtune's eager Llama 3.2 3B full
# fine-tune on one A100 (7075 tokens/s at 2 x 4096 tokens a micro-batch, README) is 49% of the
# peak at a micro-batch factor of 0.94; the others keep their gaps to it (0.45 ... 0.38 before:
# every in-sample row of bench/throughput_published.py was under-predicted by 7-24% after the
# structural fixes, the compiled ones compared at torchtune's measured compile gain).
STRATEGY_MFU = {"ddp": 0.52, "zero1": 0.50, "zero2": 0.49, "fsdp": 0.47, "zero3": 0.45}
MICRO_BATCH_HALF_TOKENS = 512
# QLoRA's dequantisation, in tokens: one pass's dequantisation of a weight (read half a byte, write
# two, at memory bandwidth) takes as long as that weight's matmuls over this many tokens, about
# 2.5-4 bytes x (achieved FLOP/s per byte/s of bandwidth: 140-300 on A100-H100) / 2 FLOPs. A flat
# factor (0.70 before) charged a 3B QLoRA at 8192 tokens a micro-batch 30%; torchtune measured 2%
# against LoRA (8035 against 8210 tokens/s, Llama 3.2 3B on an A100).
QLORA_DEQUANT_TOKENS = 256
FP32_RATE = 0.5
PCIE_GBYTES = 20.0  # achieved host<->GPU bandwidth per GPU (PCIe 4/5 x16, pinned buffers), GB/s
# CPU AdamW (DeepSpeed CPUAdam, fused torch AdamW): about 6e9 parameters/s on a ~100-core training
# node, where ~30 bytes of DRAM traffic per parameter (weight, gradient, two moments, read and
# written) take ~180 GB/s. torchtune's Llama 3.1 70B full fine-tune with fsdp_cpu_offload on
# 8 x A100 (1568 tokens/s, README: 26.6 s a step at its compile gain, of which 17.8 s compute)
# leaves about 9 s for AdamW over 70.6e9 parameters; the 2e7 per core of before took 37 s.
CPU_ADAM_PARAMS_PER_CORE_SECOND = 6e7
DEFAULT_NODE_CPUS = 96  # when the pool does not say
INTRA_NODE_GBYTES = {"nvlink": 200.0, "pcie": 20.0}  # achieved collective bandwidth per GPU, GB/s
COMM_OVERLAP = 0.5


@dataclass(frozen=True)
class JobWork:
    """What a job asks of the hardware, independent of where it runs."""

    flops_per_token: float  # without recomputation
    recompute_flops_per_token: float  # extra when gradient checkpointing is on
    tokens_per_step: int  # global batch x sequence length
    weight_bytes: float  # bytes of the weights a sharded strategy all-gathers
    grad_bytes: float  # bytes of the trainable gradients that are reduced
    trainable_params: float  # parameters the optimizer updates
    dequant_tokens: float  # QLoRA: `QLORA_DEQUANT_TOKENS`; 0 for methods that do not dequantise
    rate: float  # precision factor on the peak (fp32 on TF32)
    sequence_length: int  # the longest row attention spans: sequenceLength, or the longest example declared
    global_batch_size: int  # samples per optimizer step
    # Bytes per token that sequence parallelism's all-to-all moves in one forward over all layers: each
    # block's q, k, v and attention output (Ulysses exchanges each of them once per pass).
    exchange_bytes_per_token: float = 0.0


def active_params(arch: ModelArchitecture) -> int:
    """Parameters a token passes through (a mixture of experts routes it to a few experts; a
    multimodal checkpoint's vision tower is not run on text)."""
    return arch.active_params


def matmul_params(arch: ModelArchitecture) -> int:
    """Active parameters that multiply a token's activations: an untied input embedding is only
    looked up (a tied one is the output head too, and counted once by the architecture)."""
    embedding = 0 if arch.tie_word_embeddings else arch.params_by_kind()["embedding"]
    return active_params(arch) - embedding


def job_work(
    arch: ModelArchitecture,
    *,
    method: str,
    lora_rank: int,
    lora_targets: str | tuple[str, ...],
    precision: str,
    sequence_length: int,
    global_batch_size: int,
    step_tokens: int | None = None,
) -> JobWork:
    """`sequence_length`: the longest row a sample's attention spans; `step_tokens`: the most real
    tokens one step's samples hold (padding-free with declared micro-batch tokens), by default
    global_batch_size x sequence_length (padded rows compute on their padding too)."""
    n = float(matmul_params(arch))
    attention = 2.0 * arch.num_layers * sequence_length * arch.q_size  # forward, causal
    compute_bytes = 4 if precision == "fp32" else 2
    if method == "full":
        trainable = float(arch.total_params)
        flops = 3 * (2 * n + attention)
        weight_bytes = compute_bytes * float(arch.total_params)
    else:
        trainable = float(arch.lora_trainable_params(lora_rank, lora_targets))
        flops = 2 * (2 * n + attention) + 6 * trainable
        # QLoRA gathers NF4 weights: half a byte each plus ~1/16 for the quantisation constants.
        per_weight = 0.5625 if method == "qlora" else compute_bytes
        weight_bytes = per_weight * float(arch.total_params)
    return JobWork(
        flops_per_token=flops,
        recompute_flops_per_token=2 * n + attention,
        tokens_per_step=step_tokens if step_tokens is not None else global_batch_size * sequence_length,
        exchange_bytes_per_token=compute_bytes * arch.num_layers * (2 * arch.q_size + 2 * arch.kv_size),
        weight_bytes=weight_bytes,
        grad_bytes=compute_bytes * trainable,
        trainable_params=trainable,
        dequant_tokens=QLORA_DEQUANT_TOKENS if method == "qlora" else 0.0,
        rate=FP32_RATE if precision == "fp32" else 1.0,
        sequence_length=sequence_length,
        global_batch_size=global_batch_size,
    )


def accumulation_steps(work: JobWork, world: int, micro_batch_size: int, sequence_parallel: int = 1) -> int:
    """Micro-batches per optimizer step on each GPU: the GPUs that split one sequence run each of their
    micro-batches together (sequence parallelism), so they run `sequence_parallel` times as many."""
    return max(1, work.global_batch_size * sequence_parallel // (micro_batch_size * world))


def compute_and_communication(
    work: JobWork,
    pool: NodePool,
    *,
    nodes: int,
    gpus_per_node: int,
    strategy: str,
    gradient_checkpointing: bool,
    micro_batch_size: int,
    tflops: float | None = None,
    sequence_parallel: int = 1,
) -> tuple[float, float]:
    """Seconds of GPU compute and of collective communication in one optimizer step. Under sequence
    parallelism each GPU computes its slice of every micro-batch (the same tokens per GPU in all, in
    smaller pieces) and exchanges every block's attention inputs and output with its group."""
    world = nodes * gpus_per_node
    per_token = work.flops_per_token + (work.recompute_flops_per_token if gradient_checkpointing else 0.0)
    micro_tokens = micro_batch_size * work.tokens_per_step / work.global_batch_size / sequence_parallel
    utilisation = STRATEGY_MFU[strategy] * micro_tokens / (micro_tokens + MICRO_BATCH_HALF_TOKENS)
    dequantisation = micro_tokens / (micro_tokens + work.dequant_tokens)
    flops_per_second = world * (tflops if tflops is not None else pool.tflops) * 1e12 * utilisation * dequantisation * work.rate
    compute = per_token * work.tokens_per_step / flops_per_second

    communication = 0.0
    if world > 1:
        accumulation = accumulation_steps(work, world, micro_batch_size, sequence_parallel)
        if strategy in ("fsdp", "zero3"):
            gathers = 3 if gradient_checkpointing else 2
            volume = accumulation * (gathers * work.weight_bytes + work.grad_bytes)
        else:
            volume = 2 * work.grad_bytes
        if gpus_per_node > 1:
            communication += volume * (gpus_per_node - 1) / gpus_per_node / (INTRA_NODE_GBYTES[pool.intra_node] * 1e9)
        if nodes > 1:
            # Training nodes give each GPU its own NIC (rail-optimised): a job using k of a node's
            # GPUs gets k of its links, however few GPUs it puts on each node.
            share = gpus_per_node / pool.gpus_per_node
            link = max(pool.inter_node_gbps, 1.0) * share / 8 * 1e9
            communication += volume * (nodes - 1) / nodes / link
    if sequence_parallel > 1:
        # Ulysses: each pass over the layers (forward, its recompute, backward) sends (d-1)/d of the
        # slice's exchanged tensors, within a node when the group fits in one.
        passes = 3 if gradient_checkpointing else 2
        exchanged = passes * work.exchange_bytes_per_token * work.tokens_per_step / world
        exchanged *= (sequence_parallel - 1) / sequence_parallel
        if sequence_parallel <= gpus_per_node:
            communication += exchanged / (INTRA_NODE_GBYTES[pool.intra_node] * 1e9)
        else:
            share = gpus_per_node / pool.gpus_per_node
            communication += exchanged / (max(pool.inter_node_gbps, 1.0) * share / 8 * 1e9)
    return compute, communication


def offload_costs(
    work: JobWork,
    pool: NodePool,
    *,
    nodes: int,
    gpus_per_node: int,
    offload: str,
    gradient_checkpointing: bool,
    micro_batch_size: int,
    sequence_parallel: int = 1,
) -> tuple[float, float]:
    """Seconds of host<->GPU transfers and of the CPU optimizer step in one optimizer step."""
    if offload == "none":
        return 0.0, 0.0
    world = nodes * gpus_per_node
    pcie = PCIE_GBYTES * 1e9
    # Gradients down, updated bf16/fp32 weights up: the rank's shard of the trainable state.
    transfers = 2 * work.grad_bytes / world / pcie
    # Each rank updates its shard on its pod's cores: the node's cores shared out per GPU.
    cores_per_gpu = (pool.cpus or DEFAULT_NODE_CPUS) / pool.gpus_per_node
    cpu_step = work.trainable_params / world / (cores_per_gpu * CPU_ADAM_PARAMS_PER_CORE_SECOND)
    if offload == "optimizer+params":
        gathers = 3 if gradient_checkpointing else 2
        per_micro_step = (gathers * work.weight_bytes + work.grad_bytes) / world / pcie
        transfers += accumulation_steps(work, world, micro_batch_size, sequence_parallel) * per_micro_step
    return transfers, cpu_step


def combine(compute: float, communication: float, transfers: float, cpu_step: float) -> float:
    """Wall time of a step: compute, the traffic compute does not hide, and the CPU optimizer step."""
    return compute + max(0.0, communication + transfers - COMM_OVERLAP * compute) + cpu_step


def step_seconds(
    work: JobWork,
    pool: NodePool,
    *,
    nodes: int,
    gpus_per_node: int,
    strategy: str,
    offload: str,
    gradient_checkpointing: bool,
    micro_batch_size: int,
    tflops: float | None = None,
) -> float:
    """Predicted wall time of one optimizer step (see the module docstring for the model).

    `tflops`: the pool's GPU peak, when the caller has it at hand (it is looked up otherwise).
    """
    compute, communication = compute_and_communication(
        work, pool, nodes=nodes, gpus_per_node=gpus_per_node, strategy=strategy,
        gradient_checkpointing=gradient_checkpointing, micro_batch_size=micro_batch_size, tflops=tflops,
    )
    transfers, cpu_step = offload_costs(
        work, pool, nodes=nodes, gpus_per_node=gpus_per_node, offload=offload,
        gradient_checkpointing=gradient_checkpointing, micro_batch_size=micro_batch_size,
    )
    return combine(compute, communication, transfers, cpu_step)

"""DeepSpeed ZeRO-3 per rank, replayed from the settings the trainer sends.

Stage 3 holds, on every rank, through the whole step:

* the rank's partitions: the compute-dtype parameters of every parameter, and for the
  trainable ones the fp32 master copy, the optimizer states and the gradient partition
  (in the compute dtype: DeepSpeed accumulates gradients in the model's dtype under ZeRO);
* the persistent parameters whole (at most `param_persistence_threshold` elements each:
  norms, biases, small adapters), beside their partition;
* the reduce bucket (`reduce_bucket_size` elements, contiguous_gradients).

and at moments of the step:

* forward and backward: the gathered full parameters. `replay` follows DeepSpeed's
  parameter coordinator over the module trace (partitioned_param_coordinator.py): each
  module's fetch gathers what it lacks, then prefetches along the trace up to
  `prefetch_bucket_size` elements while fewer than `max_live_parameters` are gathered; a
  module's parameters are released after it runs unless the trace uses them again within
  `max_reuse_distance` elements. A coalesced gather of several parameters allocates one flat
  buffer, and on its first wait each parameter gets its own copy; the flat buffer lives until
  the last of them is waited for.
* backward: each trainable parameter's full gradient (compute dtype) until its hook copies it
  into the reduce bucket; a bucket that would overflow is reduce-scattered first, through a
  concatenated copy of its gradients (padded to the world size); a gradient larger than the
  bucket stays in its own tensor until the next reduce.
* optimizer step: gathered parameters are released; the gradient norm casts each trainable
  parameter's gradient partition to fp64 in turn (DeepSpeed's get_norm_dtype: fp64 wherever
  the device has it); then one sub-group (`sub_group_size` elements of the partition, closed
  at the first parameter that reaches it) at a time gets its gradients flattened (compute
  dtype, a copy when it holds more than one parameter) and cast to fp32; a fused AdamW steps
  it in place.

With the optimizer offloaded, the fp32 master copy, the optimizer states, the gradient
partition and each sub-group's fp32 gradient buffer live in host memory (pinned); the device
keeps the compute-dtype partitions (on the host too when the parameters are offloaded),
the persistent parameters, the gathered ones and the reduce bucket, and the step's copy of
an updated fp32 sub-group back into its compute-dtype partition passes through the device
(counted as one fp32 sub-group there).

Checked against DeepSpeed's own code on the CPU (bench/zero_truth.py: gloo ranks, real
tensors, the trainer's PeakTracker) with the settings scaled to the small models. Not
modelled: CUDA stream semantics (a gradient or buffer freed on the reduce stream while the
compute stream still uses it stays allocated a little longer), DeepSpeed's offload of
parameters to NVMe, and the recompute order under activation checkpointing (assumed: each
block's forward again, then its backward).
"""

from __future__ import annotations

from bisect import bisect_left
from collections import deque
from dataclasses import dataclass
from functools import lru_cache

from finetune_trainer.contract import ZERO_SETTINGS, ZeroSettings

from .architecture import ModelArchitecture


# The attention's input and output projections by the names the families give them (architecture.py);
# every other block linear is the MLP's.
_ATTENTION_INPUTS = ("q_proj", "k_proj", "v_proj", "qkv_proj", "query_key_value")
_ATTENTION_OUTPUTS = ("o_proj", "dense")


@dataclass(frozen=True)
class Param:
    """One parameter of the model, in model.parameters() order."""

    numel: int
    trainable: bool = True
    no_decay: bool = False  # the Trainer's second optimizer group (biases, norm weights)


@dataclass(frozen=True)
class ModuleTrace:
    """What DeepSpeed's hooks see over one forward and backward.

    `modules[m]` holds the indices (into `params`) of module m's own parameters (none for a
    container); `forward` and `backward` list the module of every fetch in call order
    (containers included: each fetch also prefetches). `recomputed` marks the backward fetches
    that are a checkpointed block's forward run again (no gradients come out of them).
    """

    params: tuple[Param, ...]
    modules: tuple[tuple[int, ...], ...]
    forward: tuple[int, ...]
    backward: tuple[int, ...]
    recomputed: frozenset[int] = frozenset()  # positions in `backward`


@dataclass(frozen=True)
class Replay:
    """Elements (of the compute dtype) held beyond the partitions, at the high point of each phase."""

    forward: int  # gathered parameters
    backward: int  # gathered parameters, gradients not yet in the bucket, a reduce's copy
    end_of_forward: int  # gathered when the forward ends (kept for reuse in backward)


@dataclass(frozen=True)
class Zero3Memory:
    """Bytes per rank of stage 3 (see the module docstring), by where they live."""

    weights: float  # compute-dtype partitions
    persistent: float  # persistent parameters, whole
    master: float  # fp32 master partitions
    optimizer: float  # optimizer-state partitions
    gradients: float  # gradient partitions
    reduce_bucket: float
    gathered_forward: float
    gathered_backward: float
    step_transient: float  # one sub-group's fp32 gradient (and its flattened copy), or a norm's fp64 copy
    host: float  # what offload keeps in host memory instead

    @property
    def step_above_start(self) -> float:
        """What the optimizer step adds to what it starts with: its transient, less the persistent
        parameters it partitions first; never below its start (LoRA's adapters are small enough to
        persist, and can outweigh the transient: bench/zero_truth.py --qlora on 4 ranks)."""
        return max(0.0, self.step_transient - self.persistent)


def _padded(numel: int, world: int) -> int:
    return -(-numel // world) * world


def _partition(numel: int, world: int) -> int:
    return -(-numel // world)


@dataclass(frozen=True)
class _Prepared:
    """What the replay reads of a trace, whatever the world size and settings."""

    order: tuple[int, ...]
    prefix: tuple[int, ...]  # elements traversed before each step (the reuse window counts every parameter)
    queue: tuple[tuple[int, int], ...]  # the trace's parameter queue: (parameter, step using it)
    uses: dict  # parameter -> the steps using it, ascending


@lru_cache(maxsize=256)
def _prepare(trace: ModuleTrace) -> _Prepared:
    order = trace.forward + trace.backward
    prefix = [0]
    uses: dict[int, list[int]] = {}
    for step, m in enumerate(order):
        prefix.append(prefix[-1] + sum(trace.params[i].numel for i in trace.modules[m]))
        for i in trace.modules[m]:
            uses.setdefault(i, []).append(step)
    queue = tuple((i, step) for step, m in enumerate(order) for i in sorted(trace.modules[m]))
    return _Prepared(order, tuple(prefix), queue, {i: tuple(v) for i, v in uses.items()})


def replay(trace: ModuleTrace, settings: ZeroSettings = ZERO_SETTINGS, world: int = 1) -> Replay:
    """Follow DeepSpeed's parameter coordinator (with a complete trace, as from the third step on)
    and the gradient hooks over one forward and backward; the peak elements of each phase."""
    params = trace.params
    persistent = [p.numel <= settings.param_persistence_threshold for p in params]
    prepared = _prepare(trace)
    order, prefix, uses = prepared.order, prepared.prefix, prepared.uses
    n_forward = len(trace.forward)
    mods = trace.modules
    queue = deque(prepared.queue)

    storage: dict[tuple, int] = {}  # live buffers: ("param", i), ("flat", batch), ("grad", i), ("cat",)
    live = 0
    available: set[int] = set()  # gathered (or in flight), not persistent
    pending: dict[int, int] = {}  # param -> coalesced batch not yet waited for by that param
    batches: dict[int, dict] = {}
    n_available = 0
    most_recent: dict[int, int] = {}

    def alloc(key, n):
        nonlocal live
        assert key not in storage, key
        storage[key] = n
        live += n

    def free(key):
        nonlocal live
        live -= storage.pop(key, 0)

    def gather(batch: list[int]) -> None:
        nonlocal n_available
        batch = [i for i in batch if not persistent[i] and i not in available]
        if not batch:
            return
        for i in batch:
            available.add(i)
            n_available += params[i].numel
        if len(batch) == 1:  # a single parameter is gathered into its own (padded) buffer
            alloc(("param", batch[0]), _padded(params[batch[0]].numel, world))
            return
        key = len(batches)
        batches[key] = {"members": set(batch), "done": False}
        alloc(("flat", key), sum(_padded(params[i].numel, world) for i in batch))
        for i in batch:
            pending[i] = key

    def wait(i: int) -> None:
        key = pending.pop(i, None)
        if key is None:
            return
        batch = batches[key]
        if not batch["done"]:  # the first wait copies every member out of the flat buffer
            batch["done"] = True
            for j in batch["members"]:
                alloc(("param", j), params[j].numel)
        batch["members"].discard(i)
        if not batch["members"]:  # every member waited for: the flat buffer goes
            free(("flat", key))

    def release(module: int, step: int) -> None:
        nonlocal n_available
        for i in mods[module]:
            if persistent[i] or i not in available:
                continue
            if most_recent.get(i, -10**18) > step:
                continue  # its next use was skipped over by a prefetch: kept for it
            steps = uses[i]
            k = bisect_left(steps, step)
            if k < len(steps) and prefix[steps[k]] - prefix[step] < settings.max_reuse_distance:
                continue  # used again within the reuse distance
            available.discard(i)
            n_available -= params[i].numel
            free(("param", i))

    bucket: list[int] = []  # parameters whose gradients are in the reduce bucket
    bucket_elements = 0
    own_grads: list[int] = []  # gradients too large for the bucket, in their own tensors

    def reduce_bucket() -> None:
        nonlocal bucket_elements
        tensors = bucket
        if not (len(tensors) == 1 and params[tensors[0]].numel % world == 0):
            alloc(("cat",), sum(_padded(params[i].numel, world) for i in tensors))
        peaks.append(live)
        free(("cat",))
        for i in own_grads:
            free(("grad", i))
        own_grads.clear()
        bucket.clear()
        bucket_elements = 0

    def gradient(i: int) -> None:
        nonlocal bucket_elements
        n = params[i].numel
        alloc(("grad", i), n)
        peaks.append(live)
        if bucket and bucket_elements + n > settings.reduce_bucket_size:
            reduce_bucket()
        if bucket_elements + n <= settings.reduce_bucket_size:
            free(("grad", i))  # copied into the bucket
        else:
            own_grads.append(i)
        bucket.append(i)
        bucket_elements += n

    forward_peak = backward_peak = 0
    end_of_forward = 0
    peaks: list[int] = []
    for step, module in enumerate(order):
        if step == n_forward:
            end_of_forward = live
        own = list(mods[module])
        gather(own)
        for i in own:
            wait(i)
        # Prefetch: first take this module's own entries off the queue, then walk ahead.
        fresh = [i for i in set(own) if most_recent.get(i, -10**18) < step]
        taken = 0
        while queue and taken < len(fresh):
            i, used_at = queue.popleft()
            most_recent[i] = used_at
            taken += 1
        budget = min(settings.max_live_parameters - n_available, settings.prefetch_bucket_size)
        ahead: list[int] = []
        numel = 0
        while queue and numel < budget:
            i, used_at = queue.popleft()
            if not persistent[i] and i not in available and i not in ahead:
                ahead.append(i)
                numel += params[i].numel
            most_recent[i] = max(most_recent.get(i, -10**18), used_at)
        gather(ahead)
        peaks.append(live)
        if step >= n_forward and step - n_forward not in trace.recomputed:
            for i in own:
                if params[i].trainable:
                    gradient(i)
        release(module, step + 1)
        if step < n_forward:
            forward_peak = max([forward_peak] + peaks)
        else:
            backward_peak = max([backward_peak] + peaks)
        peaks.clear()
    if bucket:
        reduce_bucket()
        backward_peak = max([backward_peak] + peaks)
    return Replay(forward=forward_peak, backward=backward_peak, end_of_forward=end_of_forward)


def largest_sub_group(trace: ModuleTrace, settings: ZeroSettings, world: int) -> tuple[int, int]:
    """(elements, parameters) of the largest optimizer sub-group of a rank's trainable partition:
    each optimizer group (decay, no-decay) is cut into sub-groups, each closed at the first
    parameter that brings it to `sub_group_size` elements."""
    largest, count = 0, 0
    for no_decay in (False, True):
        group = [_partition(p.numel, world) for p in trace.params if p.trainable and p.no_decay == no_decay]
        if sum(group) <= settings.sub_group_size:
            sub_groups = [group] if group else []
        else:
            sub_groups, current, total = [], [], 0
            for n in group:
                current.append(n)
                total += n
                if total >= settings.sub_group_size:
                    sub_groups.append(current)
                    current, total = [], 0
            if current:
                sub_groups.append(current)
        for sub in sub_groups:
            if sum(sub) > largest:
                largest, count = sum(sub), len(sub)
    return largest, count


@lru_cache(maxsize=1024)
def rank_memory(trace: ModuleTrace, *, world: int, compute_bytes: int, optimizer_bytes_per_param: float,
                offload: str = "none", settings: ZeroSettings = ZERO_SETTINGS) -> Zero3Memory:
    """Stage 3's bytes per rank for `trace` (the module docstring says what each term is)."""
    params = trace.params
    all_part = sum(_partition(p.numel, world) for p in params)
    trainable_part = sum(_partition(p.numel, world) for p in params if p.trainable)
    persistent = sum(p.numel for p in params if p.numel <= settings.param_persistence_threshold)
    master_bytes = 4 if compute_bytes == 2 else 0  # fp32 training keeps no separate master copy
    weights = compute_bytes * all_part
    master = master_bytes * trainable_part
    optimizer = optimizer_bytes_per_param * trainable_part
    gradients = compute_bytes * trainable_part
    sub_elements, sub_params = largest_sub_group(trace, settings, world)
    host = 0.0
    if offload in ("optimizer", "optimizer+params"):
        # Host: master, states, the gradient partition and every sub-group's fp32 gradient buffer.
        host += master + optimizer + gradients + 4 * trainable_part
        master = optimizer = gradients = 0.0
        step = 4.0 * sub_elements  # the updated fp32 sub-group on its way back into the partition
    else:
        flattened = compute_bytes * sub_elements if sub_params > 1 else 0
        step = flattened + 4.0 * sub_elements
    # Before the sub-groups: the gradient norm's fp64 copy of the largest gradient partition.
    # (With the optimizer offloaded DeepSpeed takes each norm in backward, as the partition goes
    # to the host; that copy is not counted.)
    largest_part = max((_partition(p.numel, world) for p in params if p.trainable), default=0)
    if offload not in ("optimizer", "optimizer+params"):
        step = max(step, 8.0 * largest_part)
    if offload == "optimizer+params":
        host += weights
        weights = 0.0
    gathered = _cached_replay(trace, settings, world)
    return Zero3Memory(
        weights=float(weights), persistent=float(compute_bytes * persistent), master=float(master),
        optimizer=float(optimizer), gradients=float(gradients),
        reduce_bucket=float(compute_bytes * settings.reduce_bucket_size),
        gathered_forward=float(compute_bytes * gathered.forward),
        gathered_backward=float(compute_bytes * gathered.backward),
        step_transient=float(step), host=float(host),
    )


def _cached_replay(trace: ModuleTrace, settings: ZeroSettings, world: int) -> Replay:
    # The world size enters the replay only through padding to a multiple of it: where every
    # parameter divides evenly (the usual case) every world size replays as one.
    if all(p.numel % world == 0 for p in trace.params):
        world = 1
    return _replay_once(trace, settings, world)


@lru_cache(maxsize=256)
def _replay_once(trace: ModuleTrace, settings: ZeroSettings, world: int) -> Replay:
    return replay(trace, settings, world)


# ---- the module trace of a transformers decoder --------------------------------------------------


class _Builder:
    def __init__(self) -> None:
        self.params: list[Param] = []
        self.modules: list[tuple[int, ...]] = []

    def param(self, numel: int, trainable: bool, no_decay: bool = False) -> int:
        self.params.append(Param(numel, trainable, no_decay))
        return len(self.params) - 1

    def module(self, *params: int) -> int:
        self.modules.append(tuple(params))
        return len(self.modules) - 1


@dataclass(frozen=True)
class _Node:
    """A module call: its id and the calls it makes, in order."""

    module: int
    children: tuple["_Node", ...] = ()

    def pre_order(self) -> list[int]:
        out = [self.module]
        for c in self.children:
            out += c.pre_order()
        return out

    def backward_order(self) -> list[int]:
        """Pre-backward hooks fire when a module's output gradient arrives: the container first,
        then its children in reverse."""
        out = [self.module]
        for c in reversed(self.children):
            out += c.backward_order()
        return out


def nf4_storage_elements(values: int, storage_bytes: int = 2) -> int:
    """Elements of the parameter bitsandbytes packs `values` 4-bit codes into, stored in a dtype of
    `storage_bytes` (bnb_4bit_quant_storage: the compute dtype under ZeRO-3 and FSDP)."""
    return -(-values // 2) // storage_bytes


@lru_cache(maxsize=512)
def decoder_trace(arch: ModelArchitecture, method: str, lora_rank: int, lora_targets, lora_dropout: bool,
                  gradient_checkpointing: bool) -> ModuleTrace:
    """The module calls transformers' decoder makes (embedding, rotary, per block: the layer,
    its norms, attention with q/k/v/o, the MLP with its projections and activation; final norm,
    head), with peft's LoRA layers (base layer, dropout, lora_A, lora_B) on the adapted linears.
    QLoRA: each block linear's weight is bitsandbytes' packed 4-bit codes held in a compute-dtype
    parameter (`bnb_4bit_quant_storage`, which lets ZeRO-3 partition it like any bf16 tensor): a
    quarter of its values in bf16 elements (two codes a byte, two bytes an element)."""
    full = method == "full"
    b = _Builder()
    hidden = arch.hidden_size
    embed = b.param(arch.vocab_size * hidden, full)
    adapted = {lin.name for lin in arch.resolve_lora_targets(lora_targets)} if not full else set()

    def adapter(base: _Node, in_features: int, out_features: int) -> _Node:
        """peft's LoRA layer around `base`: the base layer, dropout, lora_A, lora_B."""
        a = _Node(b.module(b.param(lora_rank * in_features, True)))
        bb = _Node(b.module(b.param(lora_rank * out_features, True)))
        children = (base, _Node(b.module()), a, bb) if lora_dropout else (base, a, bb)
        return _Node(b.module(), children)

    def linear(lin) -> _Node:
        experts = lin.experts if lin.name.startswith("experts.") else 1
        values = lin.in_features * lin.out_features * experts
        weight = b.param(nf4_storage_elements(values) if method == "qlora" else values, full)
        bias = [b.param(lin.out_features * experts, full, no_decay=True)] if lin.bias else []
        if lin.name not in adapted:
            return _Node(b.module(weight, *bias))
        return adapter(_Node(b.module(weight, *bias)), lin.in_features * experts, lin.out_features * experts)

    def norm(width: int) -> _Node:
        return _Node(b.module(b.param(width, full, no_decay=True)))

    blocks = []
    extra = arch.qk_norm_params + (arch.num_attention_heads if arch.traits.attention_sinks else 0)
    for layer in range(arch.num_layers):
        dense = arch.is_moe and arch.num_moe_layers < arch.num_layers and layer in arch.dense_layers
        linears = arch._dense_block_linears if (dense or not arch.is_moe) else arch.block_linears()
        by_name = {lin.name: lin for lin in linears}
        attn_names = [n for n in _ATTENTION_INPUTS if n in by_name]
        # The attention's output projection: o_proj, or `dense` (phi, gpt_neox).
        out_name = next(n for n in _ATTENTION_OUTPUTS if n in by_name)
        attention = [linear(by_name[n]) for n in attn_names]
        if extra:
            attention.append(_Node(b.module(b.param(extra, full, no_decay=True))))
        attention.append(linear(by_name[out_name]))
        mlp_lins = [lin for lin in linears if lin.name not in (*attn_names, out_name)]
        names = [lin.name for lin in mlp_lins]
        if names[:2] == ["gate_proj", "up_proj"]:
            # down_proj(act_fn(gate_proj(x)) * up_proj(x)): gate, its activation, up, down
            mlp = [linear(mlp_lins[0]), _Node(b.module()), *(linear(lin) for lin in mlp_lins[1:])]
        else:  # a fused gate_up (or the experts), the activation, the last projection
            mlp = [linear(lin) for lin in mlp_lins[:-1]] + [_Node(b.module())] + [linear(mlp_lins[-1])]
        norms = [norm(hidden) for _ in range(arch.traits.norms_per_layer)]
        attention_node, mlp_node = _Node(b.module(), tuple(attention)), _Node(b.module(), tuple(mlp))
        if len(norms) <= 2:  # Llama: input norm, attention, post-attention norm, MLP
            children = (norms[0], attention_node, *norms[1:], mlp_node)
        else:  # Gemma 2/3: the sub-layers' output norms and the pre-feedforward norm
            children = (norms[0], attention_node, *norms[1:-1], mlp_node, norms[-1])
        blocks.append(_Node(b.module(), children))
    final_norm = norm(hidden)
    head_param = embed if arch.tie_word_embeddings else b.param(arch.vocab_size * hidden, full)
    head = _Node(b.module(head_param))
    if not full and arch.head_adapted(lora_targets):  # the head's adapter (lora.targetModules names it)
        head = adapter(head, hidden, arch.vocab_size)
    embedding = _Node(b.module(embed))
    rotary = _Node(b.module())
    if arch.vision is not None:  # partitioned like the rest, never run on text
        b.param(arch.vision.params, full)
    model = _Node(b.module(), (embedding, rotary, *blocks, final_norm))
    top = _Node(b.module(), (model, head))
    forward = top.pre_order()
    recomputed: set[int] = set()
    if not gradient_checkpointing:
        backward = top.backward_order()
    else:
        # Each block is recomputed (its forward fetches again) just before its backward.
        backward = [top.module, head.module, model.module, final_norm.module]
        recomputed = set()
        for block in reversed(blocks):
            again = block.pre_order()
            recomputed.update(range(len(backward), len(backward) + len(again)))
            backward += again + block.backward_order()
        backward += [rotary.module, embedding.module]
    if not full:
        # A frozen embedding's output needs no gradient: its backward hooks never fire.
        assert backward[-2:] == [rotary.module, embedding.module]
        backward = backward[:-2]
    return ModuleTrace(tuple(b.params), tuple(b.modules), tuple(forward), tuple(backward), frozenset(recomputed))

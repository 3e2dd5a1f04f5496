"""Sequence parallelism (`training.sequenceParallel`): DeepSpeed's Ulysses (ALST), as transformers'
Trainer runs it through accelerate's `ParallelismConfig(sp_backend="deepspeed")`. Each micro-batch's
sequence is split over `sequenceParallel` GPUs: every GPU runs the model on its slice of the tokens,
and around attention an all-to-all trades the sequence split for a split of the heads, so each GPU
attends over the whole sequence with its share of the heads. Activations and logits per GPU shrink by
the degree; what a step trains does not change (the loss is the token-weighted mean over the slices).

What the trainer does for it (model_setup.sequence_parallel_arguments, data.Collator, training.py):
the ParallelismConfig, position ids in every batch (the causal order after the all-to-all comes from
them, not from a mask), each row padded to a multiple of the degree. The GPUs of one sequence read
their own micro-batches, which the adapter of DeepSpeed then runs one after the other on all of them:
so the data-parallel size is GPUs / degree, and accumulation is the degree times what it would be
(`ranks_per_replica`). The GPU count still divides globalBatchSize / micro-batch as without the split:
a step then runs whole rounds of the group's micro-batches, so what a step trained on is a prefix of
the run's sample order and a resume starts exactly after it. The memory term is sizing/activations.py (`TrainingSetup.sequence_shard`).

The planner turns it on only when no plan fits without it (`last_resort`): it costs an all-to-all of
every layer's attention inputs and outputs, which the step-time model prices. What stays out, each
refused naming the field: strategies other than DeepSpeed's (zero1-3; the SP backend is DeepSpeed's),
QLoRA, Liger's kernels and activation offloading (not run with it here), the optimizer step in
backward (it needs one micro-batch per step). The chunked loss runs on each GPU's slice
(training._split_chunked, inside transformers' loss of the split). The sizing
refuses degrees that do not divide the attention heads and models with sliding-window or eager-only
attention (the masks are dropped: causality comes from position ids alone); the API refuses eager
attention and packed or padding-free data under sdpa (their block-diagonal mask would be dropped).
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from ..rules import Rule, one_of
from .lever import AutoOrInt, Lever, LeverField, Setting

# The degrees the planner tries when the job leaves it `auto` (and nothing fits without it).
AUTO_DEGREES = (2, 4, 8, 16)
MAX_DEGREE = 64


def _ask(training, method: str, logit_transform: bool) -> tuple[tuple[int, ...], bool]:
    value = training.sequence_parallel
    if value == "auto":
        return (1, *AUTO_DEGREES), False
    return (value,), True


def _choice_values(setting: Setting) -> dict:
    degree = setting["sequence_parallel"]
    # A choice of its own name (not the field's): the rules read whether the sequence is split, not the
    # degree, so the CRD's CEL cannot test them on the field (they stay with the API's validator).
    return {"sequence_split": None if degree is None else degree > 1}


def _sized(training, method: str, arch, notes: list) -> dict:
    value = training.sequence_parallel
    if value == "auto":
        notes.append("training.sequenceParallel is auto: sized without sequence parallelism")
        return {"sequence_parallel": 1}
    return {"sequence_parallel": value}


def _ranks(setting: Setting) -> int:
    return setting["sequence_parallel"]


def _words(setting: Setting) -> str:
    return f"sequence split over {setting['sequence_parallel']} GPUs"


def _describe_change(old: Setting, new: Setting) -> str:
    if new["sequence_parallel"] == old["sequence_parallel"]:
        return ""
    return f"sequence parallel {old['sequence_parallel']} -> {new['sequence_parallel']}"


LEVER = Lever(
    name="sequence_parallel",
    off={"sequence_parallel": 1},
    auto={"sequence_parallel": "auto"},
    schema={"sequence_parallel": LeverField(
        Annotated[int, Field(ge=1, le=MAX_DEGREE)],
        "GPUs each sequence is split across (DeepSpeed Ulysses); 1: off.")},
    spec={"sequence_parallel": LeverField(AutoOrInt(1, MAX_DEGREE, "sequence-parallel degree"), """
        Split each sequence over this many GPUs (DeepSpeed's Ulysses sequence parallelism): each GPU holds the
        activations and logits of its slice of the tokens, and attention trades the split for one of the heads
        by an all-to-all. For contexts whose activations do not fit one GPU. It must divide the GPU count and the
        model's attention heads; the data-parallel size is GPUs / degree. Needs strategy zero1, zero2 or zero3,
        method full or lora, sdpa or flash attention (flash for packing and paddingFree), and none of
        ligerKernel, activationOffloading and optimizerInBackward. 1: off. `auto`: the planner splits the
        sequence only when no plan fits without it.""")},
    ask=_ask,
    choice_values=_choice_values,
    rules=(
        Rule("sequence-parallel-strategy", {"sequence_split": one_of(True), "strategy": one_of("ddp", "fsdp")},
             "sequence_split",
             "sequence parallelism runs on DeepSpeed (Ulysses): use strategy zero1, zero2 or zero3"),
        Rule("sequence-parallel-qlora", {"sequence_split": one_of(True), "method": one_of("qlora")},
             "sequence_split", "sequence parallelism is not run with qlora here: use method lora or full"),
        Rule("sequence-parallel-liger", {"sequence_split": one_of(True), "liger_kernel": one_of(True)},
             "sequence_split", "sequence parallelism is not run with Liger's kernels here: turn one of them off"),
        Rule("sequence-parallel-activation-offloading",
             {"sequence_split": one_of(True), "activation_offloading": one_of(True)}, "sequence_split",
             "sequence parallelism is not run with activation offloading here: turn one of them off"),
        Rule("sequence-parallel-optimizer-in-backward",
             {"sequence_split": one_of(True), "optimizer_in_backward": one_of(True)}, "sequence_split",
             "the optimizer step in backward needs one micro-batch per step, and the GPUs of a split sequence "
             "run one micro-batch each of theirs in turn: turn one of them off"),
    ),
    quality_cost=2,  # an all-to-all per layer; the result is the same
    last_resort=True,
    ranks_per_replica=_ranks,
    sized=_sized,
    rung="sequenceParallel",
    rung_after="moreGPUs",
    label="sequence parallelism",
    phrase="sequence parallelism",
    words=_words,
    change="sequence parallelism",
    describe_change=_describe_change,
)


def attention_refusal(degree: int | str, attention: str, packed: bool) -> str | None:
    """Why a job cannot split its sequences `degree` ways with this attention and data (`packed`: packing
    or paddingFree), or None. Ulysses drops the attention mask (a mask over the whole sequence would cost
    its square) and takes causality from the position ids: eager attention needs the mask, and so do
    packed rows under sdpa; flash reads the boundaries from the position ids. The API and the trainer
    config both ask this."""
    if not isinstance(degree, int) or degree <= 1:
        return None
    if attention == "eager":
        return ("sequence parallelism needs sdpa or flash attention: Ulysses drops the attention mask, which eager "
                "attention needs")
    if packed and attention != "flash":
        return ("sequence parallelism with packing or paddingFree needs flash attention: Ulysses drops the "
                "block-diagonal mask that sdpa would need, flash reads the boundaries from the position ids")
    return None

"""Liger's kernels (`training.ligerKernel`): linkedin's liger-kernel swaps, in the model transformers
built, the loss for its fused linear cross-entropy (the head and the loss run on chunks of tokens and
their gradients are computed in the forward, so the logits never exist whole), and RMSNorm, SwiGLU
and RoPE for fused Triton kernels that keep fewer tensors for backward. The Trainer applies them
itself (`TrainingArguments.use_liger_kernel`, this lever's `trainer_arguments`); the memory model's
Liger terms are in sizing/activations.py (`_liger_norm_saved`, the MLP, `_liger_logits_bytes`).

Triton needs a GPU, and the planner cannot tell a node's real GPU from the lab's (nodes that
advertise GPUs and run the trainer on their CPU look the same to it): so the planner never turns
it on by itself. A job asks for it (`ligerKernel: true`), on a cluster it knows has real GPUs; the
trainer refuses it on a node that shows none (ConfigError, naming the field). Recovery has no rung
for it: a rung may only free a lever the planner can choose, and this one it cannot.

Its fused loss does the chunked loss's work (`replaces`): with it the loss runs in one piece
through Liger. Liger reads the head's weight outside the head's forward, which DeepSpeed ZeRO-3
never gathers (FSDP's grouped tail is gathered by the final norm's forward): refused under zero3.
"""

from __future__ import annotations

from ..rules import Rule, one_of
from .lever import Lever, LeverField, Setting

# What the Trainer hands liger_kernel.transformers._apply_liger_kernel_to_instance: every kernel
# the memory terms count, the fused loss in place of the plain one (Liger's own defaults differ by
# family, e.g. granite's plain cross-entropy).
KERNELS = {"rope": True, "rms_norm": True, "swiglu": True, "fused_linear_cross_entropy": True,
           "cross_entropy": False}


def _ask(training, method: str, logit_transform: bool) -> tuple[tuple[bool, ...], bool]:
    # Never the planner's choice: off unless the job asks for it (the module docstring says why).
    value = training.liger_kernel
    return ((False,), False) if value is None else ((value,), True)


def _sized(training, method: str, arch, notes: list) -> dict:
    # Unset is off, not the planner's to choose: no note.
    return {"liger_kernel": bool(training.liger_kernel)}


def _trainer_arguments(setting: Setting) -> dict:
    return {"use_liger_kernel": True, "liger_kernel_config": dict(KERNELS)}


def _words(setting: Setting) -> str:
    return "Liger kernels"


LEVER = Lever(
    name="liger_kernel",
    off={"liger_kernel": False},
    auto={"liger_kernel": None},
    schema={"liger_kernel": LeverField(
        bool, "Liger's Triton kernels: fused linear cross-entropy, RMSNorm, SwiGLU and RoPE (needs GPUs).")},
    spec={"liger_kernel": LeverField(bool | None, """
        Run the model with linkedin's Liger kernels (Triton): the head and the cross-entropy fused and run over
        chunks of tokens (the logits never exist whole), and RMSNorm, SwiGLU and RoPE as fused kernels that keep
        fewer tensors for backward. Needs real GPUs (the trainer refuses it on a node without one), a Llama,
        Mistral or Qwen2 model (the families whose memory the planner models with it), and a strategy other than
        zero3; lossChunks is then 1 (the fused loss chunks itself). Omit or false: off. The planner never turns
        it on by itself, since it cannot tell whether the nodes' GPUs are real.""")},
    ask=_ask,
    rules=(
        Rule("liger-chunked-loss", {"liger_kernel": one_of(True), "chunked_loss": one_of(True)}, "chunked_loss",
             "Liger's fused linear cross-entropy chunks the head and the loss itself: use lossChunks 1 (or auto)"),
        Rule("liger-zero3", {"liger_kernel": one_of(True), "strategy": one_of("zero3")}, "liger_kernel",
             "Liger's fused loss reads the output projection's weight outside its forward, which DeepSpeed ZeRO-3"
             " never gathers: use ddp, fsdp, zero1 or zero2"),
    ),
    quality_cost=0,  # the same model and loss, computed by other kernels
    sized=_sized,
    replaces=("loss_chunks",),
    needs_cuda="Liger's Triton kernels",
    package="liger_kernel",
    trainer_arguments=_trainer_arguments,
    label="Liger kernels",
    phrase="Liger's kernels",
    words=_words,
)

"""The chunked loss (`training.lossChunks`): the head and the cross-entropy run per sequence
chunk, so the fp32 logits of the whole micro-batch never exist at once (the trainer's
chunked_loss.py; the memory model's `logits_bytes`, sizing/activations.py). The same loss, so
`auto` simply uses it, unless the model transforms its logits after the head (which the chunks would bypass)."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from ..rules import Rule, one_of
from .lever import AutoOrInt, Lever, LeverField, Setting

# What `training.lossChunks: auto` means (torchtune's 8 chunks).
AUTO_LOSS_CHUNKS = 8


def _auto_chunks(logit_transform: bool) -> int:
    return 1 if logit_transform else AUTO_LOSS_CHUNKS


def _ask(training, method: str, logit_transform: bool) -> tuple[tuple[int, ...], bool]:
    if training.loss_chunks == "auto":
        return (_auto_chunks(logit_transform),), False
    return (training.loss_chunks,), True


def _choice_values(setting: Setting) -> dict:
    # combinations.py reads whether the loss is chunked, not into how many chunks.
    chunks = setting["loss_chunks"]
    return {"chunked_loss": None if chunks is None else chunks > 1}


def _sized(training, method: str, arch, notes: list) -> dict:
    chunks = training.loss_chunks
    if chunks == "auto":
        chunks = _auto_chunks(bool(arch.final_logit_softcapping))
    return {"loss_chunks": chunks}


def _words(setting: Setting) -> str:
    return f"loss in {setting['loss_chunks']} chunks"


def _describe_change(old: Setting, new: Setting) -> str:
    if new["loss_chunks"] == old["loss_chunks"]:
        return ""
    return f"loss chunks {old['loss_chunks']} -> {new['loss_chunks']}"


LEVER = Lever(
    name="loss_chunks",
    off={"loss_chunks": 1},
    auto={"loss_chunks": "auto"},
    schema={"loss_chunks": LeverField(
        Annotated[int, Field(ge=1)], "Sequence chunks of the cross-entropy (1: the plain loss).")},
    spec={"loss_chunks": LeverField(AutoOrInt(1, 64, "number of loss chunks"), """
        Compute the cross-entropy over this many sequence chunks, so the fp32 logits of the whole micro-batch
        never exist at once (the loss is the same); 1: the plain loss. `auto`: 8, as torchtune.""")},
    ask=_ask,
    choice_values=_choice_values,
    rules=(
        Rule("chunked-loss-logit-transform", {"chunked_loss": one_of(True), "logit_transform": one_of(True)},
             "chunked_loss",
             "the model changes its logits after the output projection (soft-capping or a logit scale), which the"
             " chunked loss would bypass: use lossChunks 1"),
    ),
    quality_cost=0,  # the same loss
    traced_by_profile=True,  # it only lowers the logits' peak: the plain loss's measured figure over-estimates it
    sized=_sized,
    rung="chunkedLoss",
    rung_after="gradientCheckpointing",
    label="chunked loss",
    phrase="the chunked loss",
    words=_words,
    in_reasons=False,
    describe_change=_describe_change,
)

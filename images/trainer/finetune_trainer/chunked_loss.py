"""Cross-entropy over sequence chunks (``lossChunks``): the full fp32 logits never exist.

A causal LM's plain loss materialises logits of ``batch x sequence x vocabulary`` (in
the compute dtype, then an fp32 copy for the softmax), and autograd keeps the fp32
log-softmax for backward: for a 128k vocabulary that is the largest tensor of the step.
Here the output projection and the loss run on one chunk of the sequence at a time,
each chunk under activation checkpointing: forward keeps only the chunk's summed loss,
backward recomputes one chunk's logits at a time. At most one chunk's logits exist.

How it is wired without changing the model's code or parameter names: the output
embedding module (``lm_head``) gets an instance-level ``forward`` that, while labels are
pending (set by the trainer just before the model call), returns the summed loss of its
input hidden states instead of logits; the model returns that scalar in ``logits``. Model
code that changes logits after the output projection (soft-capping, logit scales) or
adds an auxiliary router loss only when labels are given would be bypassed: such models
are refused by name (``unsupported_reason``).

Normalisation is exactly the plain loss's: labels are shifted left by one with -100
padding (positions labelled -100 count for nothing), the summed loss is divided by the
number of labelled tokens of the whole optimizer step (``num_items_in_batch``, counted
by the Trainer over all micro-batches and ranks) when given, else by this micro-batch's.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

IGNORE_INDEX = -100


def shift_labels(labels: torch.Tensor) -> torch.Tensor:
    """Position t predicts token t+1; the last position predicts nothing."""
    return F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:].contiguous()


def _chunk_loss(project, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    logits = project(hidden).float()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                           ignore_index=IGNORE_INDEX, reduction="sum")


def chunked_cross_entropy(hidden: torch.Tensor, shifted_labels: torch.Tensor, project, chunks: int,
                          divisor: torch.Tensor | int | float) -> torch.Tensor:
    """Summed cross-entropy of ``project(hidden)`` against labels, chunk by chunk over the
    sequence, divided by ``divisor``. ``hidden``: batch x sequence x hidden."""
    total = None
    for hidden_chunk, label_chunk in zip(hidden.chunk(chunks, dim=1), shifted_labels.chunk(chunks, dim=1)):
        if torch.is_grad_enabled():
            part = checkpoint(_chunk_loss, project, hidden_chunk, label_chunk, use_reentrant=False)
        else:
            part = _chunk_loss(project, hidden_chunk, label_chunk)
        total = part if total is None else total + part
    if isinstance(divisor, torch.Tensor):
        divisor = divisor.to(total.device)
    return total / divisor


# Config keys of models that transform logits after the output projection.
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


def unsupported_reason(config) -> str | None:
    for key in _LOGIT_TRANSFORMS:
        if getattr(config, key, None) not in (None, 1, 1.0):
            return (f"model type {getattr(config, 'model_type', '?')} applies {key} to the logits after the output "
                    f"projection, which the chunked loss would bypass")
    if getattr(config, "output_router_logits", False):
        return "the model adds its router auxiliary loss only when given labels (output_router_logits is on)"
    return None


def causal_lm(model):
    """The transformers CausalLM inside peft's wrapper (peft's own accessor)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) and hasattr(model, "peft_config") else model


class ChunkedLoss:
    """Installs the chunked loss on a model's output projection; ``arm`` before each
    training forward, the model's output ``logits`` is then the loss."""

    def __init__(self, model, chunks: int):
        self.chunks = chunks
        lm = causal_lm(model)
        reason = unsupported_reason(lm.config)
        if reason:
            raise ValueError(reason)
        head = lm.get_output_embeddings()
        if head is None:
            raise ValueError(f"{type(lm).__name__} has no output embeddings (lm_head) to chunk")
        self.head = head
        self._pending: tuple[torch.Tensor, torch.Tensor | int | float] | None = None
        plain_forward = head.forward  # the class's forward, bound
        owner = self

        def forward(module, hidden_states):
            pending, owner._pending = owner._pending, None
            if pending is None:
                return plain_forward(hidden_states)  # generation, evaluation: plain logits
            labels, divisor = pending
            return chunked_cross_entropy(hidden_states, labels, plain_forward, owner.chunks, divisor)

        head.forward = types.MethodType(forward, head)

    def arm(self, labels: torch.Tensor, divisor: torch.Tensor | int | float | None, *, shifted: bool = False) -> None:
        """`shifted`: the labels are shifted already (sequence parallelism's `shift_labels`: a slice of
        the sequence cannot shift its own last label, DeepSpeed's adapter shifted the whole row)."""
        if not shifted:
            labels = shift_labels(labels)
        if divisor is None:
            divisor = labels.ne(IGNORE_INDEX).sum()
        self._pending = (labels, divisor)

    def loss(self, model, inputs: dict, num_items_in_batch=None) -> torch.Tensor:
        """The model's forward with the chunked loss in place of logits."""
        inputs = dict(inputs)
        labels = inputs.pop("labels")
        self.arm(labels, num_items_in_batch)
        return self._forward(model, inputs)

    def slice_mean(self, model, inputs: dict) -> torch.Tensor:
        """Sequence parallelism: the mean loss of this rank's slice of the sequence, over its labelled
        tokens (0 when it has none), from the slice's shifted labels; transformers'
        deepspeed_sp_compute_loss weighs the slices of a sequence by their tokens."""
        inputs = dict(inputs)
        inputs.pop("labels", None)
        shifted = inputs.pop("shift_labels")
        self.arm(shifted, shifted.ne(IGNORE_INDEX).sum().clamp(min=1), shifted=True)
        return self._forward(model, inputs)

    def _forward(self, model, inputs: dict) -> torch.Tensor:
        try:
            outputs = model(**inputs)
        finally:
            self._pending = None
        loss = outputs["logits"] if isinstance(outputs, dict) else outputs[0]
        if loss.dim() != 0:
            raise RuntimeError("the output projection was not reached with the chunked loss armed "
                               f"(got logits of shape {tuple(loss.shape)})")
        return loss

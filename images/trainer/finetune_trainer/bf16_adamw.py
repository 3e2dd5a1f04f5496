"""AdamW whose weights, gradients and moments are all bf16: no fp32 master copy.

Full fine-tuning with ``masterWeights: bf16`` (as torchtune and lit-gpt run it) keeps
2 bytes per parameter for each of weight, gradient, first and second moment: 8 bytes
instead of the 16 of fp32 master weights with fp32 AdamW. The arithmetic of one step is
done in fp32 on a temporary copy of one parameter at a time; only the stored results are
bf16. What is lost is the low bits of the weight update: an update smaller than half a
bf16 ulp of the weight (bf16 keeps 8 significant bits) rounds away under round-to-nearest.
``rounding`` says how the updated weight is written back:

* ``nearest``: round to nearest (plain bf16 arithmetic). Small updates can vanish.
* ``stochastic``: round up or down at random with probability proportional to the
  distance, so the rounding is unbiased in expectation and small updates survive on
  average. No state: a random 16-bit integer per element is drawn during the step only.
* ``kahan``: Kahan-compensated summation. A bf16 buffer per parameter (``kahan_comp``,
  2 bytes per parameter, in the optimizer state so checkpoints carry it) holds what the
  last rounding lost; it is added to the next update before rounding.

The moments themselves are rounded to nearest: they are averages, not accumulations of
tiny increments, so their rounding error does not compound the way the weights' does.

Works on plain tensors and on FSDP2's sharded DTensors (each rank updates its shard).
"""

from __future__ import annotations

import torch
from torch.optim import Optimizer

ROUNDINGS = ("nearest", "stochastic", "kahan")


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """The rank-local storage of a DTensor (the tensor itself otherwise): elementwise
    updates of a sharded parameter need no communication."""
    return getattr(tensor, "_local_tensor", tensor)


def stochastic_round_to_bf16(value: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """fp32 -> bf16, rounding up or down at random, unbiased in expectation.

    bf16 is the top 16 bits of fp32. Adding a uniform random integer in [0, 2**16) to the
    fp32 bit pattern and then dropping the low 16 bits rounds up with probability equal to
    the dropped fraction (a carry into the exponent is the correct round-up). Integer
    addition is sign-agnostic on the bit pattern, so negative numbers round away from or
    towards zero with the same rule applied to their magnitude.
    """
    if value.dtype != torch.float32:
        value = value.float()
    bits = value.contiguous().view(torch.int32)
    noise = torch.randint(0, 1 << 16, bits.shape, dtype=torch.int32, device=bits.device, generator=generator)
    rounded = (bits + noise).bitwise_and_(-65536)  # 0xFFFF0000: keep sign, exponent, 7 mantissa bits
    return rounded.view(torch.float32).to(torch.bfloat16)


class BF16AdamW(Optimizer):
    """Decoupled-weight-decay Adam (Loshchilov & Hutter) storing everything in the
    parameter's dtype (bf16), with a choice of how updated weights are rounded."""

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, rounding: str = "nearest", seed: int = 0,
                 slice_elements: int | None = None):
        if rounding not in ROUNDINGS:
            raise ValueError(f"rounding must be one of {ROUNDINGS}, not {rounding!r}")
        if lr < 0 or eps < 0 or not (0 <= betas[0] < 1 and 0 <= betas[1] < 1):
            raise ValueError(f"invalid AdamW hyper-parameters lr={lr} betas={betas} eps={eps}")
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay})
        self.rounding = rounding
        self.slice_elements = slice_elements or STEP_SLICE_ELEMENTS
        self._seed = seed
        self._generators: dict[torch.device, torch.Generator] = {}

    def _generator(self, device: torch.device) -> torch.Generator:
        # One stream of random bits per device, seeded (with the rank mixed in by the
        # caller's seed) so a run is reproducible; it is not checkpointed, so a resumed
        # run draws other (equally unbiased) rounding noise.
        gen = self._generators.get(device)
        if gen is None:
            gen = torch.Generator(device=device)
            gen.manual_seed(self._seed)
            self._generators[device] = gen
        return gen

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr, eps, decay = group["lr"], group["eps"], group["weight_decay"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self.state[param]
                if not state:
                    # Created from the parameter itself so that under FSDP2 they are
                    # DTensors sharded like it: distributed checkpoints reshard them.
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                if self.rounding == "kahan" and "kahan_comp" not in state:
                    # Also for state loaded from a checkpoint without one (another rounding).
                    state["kahan_comp"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                state["step"] += 1
                step = float(state["step"])
                tensors = [_local(param), _local(param.grad), _local(state["exp_avg"]), _local(state["exp_avg_sq"])]
                if self.rounding == "kahan":
                    tensors.append(_local(state["kahan_comp"]))
                hyper = (beta1, beta2, lr, eps, decay, 1 - beta1 ** step, 1 - beta2 ** step)
                for pieces in _slices(tensors, self.slice_elements):
                    self._update(*pieces[:4], pieces[4] if len(pieces) > 4 else None, *hyper)
        return loss

    def _update(self, weight, grad, exp_avg, exp_avg_sq, comp, beta1, beta2, lr, eps, decay, bias1, bias2):
        """One AdamW step of (a slice of) one parameter, in fp32 temporaries."""
        grad = grad.to(torch.float32)
        # Copies (also of fp32 tensors): the in-place arithmetic below must not touch the
        # stored moments or the weight.
        m = exp_avg.to(torch.float32, copy=True).lerp_(grad, 1 - beta1)
        v = exp_avg_sq.to(torch.float32, copy=True).mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        del grad
        exp_avg.copy_(m)
        exp_avg_sq.copy_(v)
        denom = v.div_(bias2).sqrt_().add_(eps)
        old = weight.to(torch.float32, copy=True)
        # The whole change of the weight this step, in fp32: decay, then Adam.
        delta = m.div_(denom).mul_(-lr / bias1)
        del denom, v
        if decay:
            delta.add_(old, alpha=-lr * decay)
        if comp is None:
            new = old.add_(delta)
            if self.rounding == "stochastic" and weight.dtype == torch.bfloat16:
                new = stochastic_round_to_bf16(new, self._generator(weight.device))
            weight.copy_(new)
        else:  # kahan
            delta.add_(comp.to(torch.float32))
            weight.copy_(old + delta)
            # What the rounding of the weight lost, kept for the next step.
            comp.copy_(delta.sub_(weight.to(torch.float32).sub_(old)))


# Parameters are updated in slices of at most this many elements, so the fp32
# temporaries of a step (gradient, both moments, old weight, update; about 24 bytes per
# element with stochastic rounding's noise) stay bounded: 2**24 elements = 400 MB at
# most, instead of 12.6 GB for a 128k x 4096 embedding. The memory model's
# BF16_ADAMW_STEP_SLICE_ELEMENTS is this number.
STEP_SLICE_ELEMENTS = 1 << 24


def _slices(tensors: list[torch.Tensor], size: int):
    """Matching 1-D slices of same-shaped tensors (views, so updates land in place).
    A non-contiguous tensor (never a parameter in practice) is updated whole."""
    numel = tensors[0].numel()
    if numel <= size or not all(t.is_contiguous() for t in tensors):
        yield tensors
        return
    flat = [t.view(-1) for t in tensors]
    for start in range(0, numel, size):
        yield [t[start:start + size] for t in flat]


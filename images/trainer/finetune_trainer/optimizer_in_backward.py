"""The optimizer step inside backward (``optimizerInBackward``), as torchtune's
optimizer_in_bwd does it: one optimizer per parameter, stepped from that parameter's
post-accumulate-grad hook the moment its gradient is complete, and the gradient freed
at once. At most one parameter's gradient (plus what autograd is still producing)
exists at a time, instead of a gradient for every parameter.

What it cannot be combined with, and why:

* gradient accumulation > 1: each micro-batch's backward would already step;
* ZeRO (DeepSpeed owns the optimizer and the gradient partitions);
* gradient clipping by global norm: the norm is known only when every gradient exists,
  and by then all but the last have been applied and freed. The trainer turns clipping
  off and says so in its levers line.

Distribution:

* FSDP2 calls the sharded parameter's post-accumulate-grad hooks itself, after the
  reduce-scatter has put the averaged gradient shard in ``.grad``: each rank steps its
  shard.
* DDP averages gradients in buckets at the end of backward, after these hooks have run.
  Under DDP with more than one rank the trainer therefore switches DDP's own gradient
  sync off (``require_backward_grad_sync``, as ``no_sync`` does) and the hook averages
  each gradient with one all-reduce before stepping. Correct, but one collective per
  parameter without overlap is slower, and DDP's bucket buffers (one gradient-sized
  copy, allocated when DDP wraps the model) still exist: under DDP the lever frees the
  per-parameter ``.grad`` tensors only.

The wrapper is what the Trainer and the LR scheduler see: its ``param_groups`` are the
per-parameter optimizers' own group dicts, read live (a ``load_state_dict`` replaces
them), so the scheduler's learning rate reaches them;
``step`` and ``zero_grad`` do nothing (the hooks did the work). Checkpoints save and load
the per-parameter optimizers through torch.distributed.checkpoint (``optimizers``), whose
state is keyed by parameter name, so it reshards like any other optimizer state.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch.optim import Optimizer


class InBackwardOptimizer(Optimizer):
    """Holds one optimizer per trainable parameter and the hooks that step them."""

    def __init__(self, named_params: list[tuple[str, torch.nn.Parameter, float]],
                 make_optimizer: Callable[[list[dict[str, Any]]], Optimizer]):
        # Not Optimizer.__init__: there are no param groups of our own. What the LR
        # scheduler and accelerate read is set up here by hand.
        self.defaults: dict[str, Any] = {}
        self.optimizers: dict[str, Optimizer] = {}
        self._params: dict[str, torch.nn.Parameter] = {}
        self._handles = []
        self._grad_sync: Callable[[torch.Tensor], None] | None = None
        for name, param, weight_decay in named_params:
            self.optimizers[name] = make_optimizer([{"params": [param], "weight_decay": weight_decay}])
            self._params[name] = param
        if self.optimizers:
            self.defaults = dict(next(iter(self.optimizers.values())).defaults)
        self._optimizer_step_pre_hooks = {}
        self._optimizer_step_post_hooks = {}
        self._optimizer_state_dict_pre_hooks = {}
        self._optimizer_state_dict_post_hooks = {}
        self._optimizer_load_state_dict_pre_hooks = {}
        self._optimizer_load_state_dict_post_hooks = {}
        self.steps_in_backward = 0
        for name, param in self._params.items():
            self._handles.append(param.register_post_accumulate_grad_hook(self._hook_for(self.optimizers[name])))

    def _hook_for(self, optimizer: Optimizer):
        def step_now(param: torch.Tensor) -> None:
            if param.grad is None:
                return
            if self._grad_sync is not None:
                self._grad_sync(param.grad)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            self.steps_in_backward += 1

        return step_now

    def average_gradients_over(self, group=None) -> None:
        """Under DDP with DDP's own sync switched off: average each gradient over the
        ranks (one all-reduce) before its step."""
        import torch.distributed as dist

        world = dist.get_world_size(group)

        def sync(grad: torch.Tensor) -> None:
            dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=group)
            grad.div_(world)

        self._grad_sync = sync

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        # Read live every time: an optimizer's load_state_dict (accelerate's device
        # placement, a resume) replaces its group dicts, and the LR scheduler must set the
        # learning rate in the ones the optimizers use.
        return [group for opt in self.optimizers.values() for group in opt.param_groups]

    @property
    def state(self):  # read-only view, for code that inspects optimizer.state
        merged = {}
        for opt in self.optimizers.values():
            merged.update(opt.state)
        return merged

    def plain_optimizers(self) -> list[Optimizer]:
        """What torch.distributed.checkpoint saves and loads (it accepts a list)."""
        return list(self.optimizers.values())

    def step(self, closure=None):
        # The per-parameter steps already ran inside backward.
        return closure() if closure is not None else None

    def zero_grad(self, set_to_none: bool = True) -> None:
        # Gradients were freed by the hooks; any left (a parameter whose hook did not
        # fire, e.g. unused this step) is dropped like a normal zero_grad would.
        for param in self._params.values():
            param.grad = None

    def state_dict(self) -> dict[str, Any]:
        return {"per_parameter": {name: opt.state_dict() for name, opt in self.optimizers.items()}}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for name, opt in self.optimizers.items():
            if name in state_dict.get("per_parameter", {}):
                opt.load_state_dict(state_dict["per_parameter"][name])

    def remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def __repr__(self) -> str:
        kind = type(next(iter(self.optimizers.values()))).__name__ if self.optimizers else "none"
        return f"InBackwardOptimizer({len(self.optimizers)} x {kind})"

"""What LoRA trains outside the decoder blocks (issue 28): whole modules trained beside the adapters
(lora.modulesToSave, peft's `modules_to_save`: the input embedding and the output head, which
training new chat tokens needs) and a LoRA adapter on the output head (lora.targetModules naming it;
peft's `all-linear` leaves the output layer out).

peft trains a copy of each saved module and keeps the original, frozen, in the base: the base's
weights stay as they are (with tied embeddings the originals stay tied; each copy trains on its own,
so saving both trains two matrices). The trainer keeps the copies in fp32, like the adapters
(model_setup.train_in_fp32). What that costs, traced on tiny models
(tests/sizing/test_saved_modules_tracker.py) and at real sizes (bench/sizing_accuracy.py --only m=):

* the copy, its gradient and its optimizer state, counted with the adapters' (states.py);
* the head's copy: autocast's compute-dtype cast of it, cached from the forward to the head's
  backward (memory.py's weight copies); the input the head then saves for its weight gradient; and in
  the head's backward its weight gradient in the compute dtype next to the fp32 cast that becomes
  its `.grad` (memory.py's head-backward moment, `head_backward_bytes`);
* the embedding's copy: it is no autocast op, so its fp32 output makes the residual stream between
  the blocks fp32 (regime.py);
* the head's adapter: r x (hidden + vocabulary) trained values (ModelArchitecture.lora_trainable_params)
  and what its lora_A and lora_B save (activations.py).

Other modules (norms, a block's layers) are not sized and are refused, naming the field.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from .architecture import ModelArchitecture
from .errors import SizingError

if TYPE_CHECKING:
    from .setup import TrainingSetup

FIELD = "lora_modules_to_save"


@dataclass(frozen=True)
class SavedModules:
    """Parameters of the trained copies (0: that module is not saved)."""

    embedding: int = 0
    head: int = 0

    @property
    def params(self) -> int:
        return self.embedding + self.head


def head_params(arch: ModelArchitecture) -> int:
    """The output head's parameters, as one untied copy of it holds them (phi's head has a bias)."""
    return arch.vocab_size * arch.hidden_size + (arch.vocab_size if arch.traits.head_bias else 0)


def saved_modules(arch: ModelArchitecture, names: tuple[str, ...], targets: str | tuple[str, ...] = ()) -> SavedModules:
    """The trained copies `names` (lora.modulesToSave) make; SizingError naming the field for a name
    that is not the family's embedding or head, a repeated one, or one the adapters target too."""
    if isinstance(names, str) or not all(isinstance(n, str) for n in names):
        raise SizingError(FIELD, f"must be a list of module names, got {names!r}")
    if len(set(names)) != len(names):
        raise SizingError(FIELD, f"names a module twice: {list(names)}")
    if getattr(arch, "profiled", None) is not None:
        # A family only the pre-flight profile knows: the profile traced these copies (peft checked the
        # names in the profile pod, model_setup.check_modules_to_save); nothing is computed from them here.
        return SavedModules()
    embedding_name, head_name = arch.traits.embedding_module, arch.traits.head_module
    saved = SavedModules()
    for name in names:
        if name == embedding_name:
            saved = SavedModules(arch.vocab_size * arch.hidden_size, saved.head)
        elif name == head_name:
            saved = SavedModules(saved.embedding, head_params(arch))
        else:
            raise SizingError(FIELD, f"{name!r} cannot be trained in full beside the adapters: only {arch.family}'s "
                                     f"input embedding ({embedding_name!r}) and output head ({head_name!r}) are sized")
        if not isinstance(targets, str) and name in targets:
            raise SizingError(FIELD, f"{name!r} is in lora_targets too: a module is adapted or trained in full, not both")
    if not saved.embedding and not arch.resolve_lora_targets(targets):
        # Nothing in or before the blocks trains: they would save nothing for backward.
        raise SizingError("lora_targets", f"names no linear layer of {arch.family}'s blocks (only the output head): "
                                          "a job that trains nothing in the blocks is not sized; add block modules")
    return saved


def of_setup(setup: "TrainingSetup") -> SavedModules:
    """The copies a setup's lora.modulesToSave trains (none for full fine-tuning)."""
    if setup.method == "full":
        return SavedModules()
    return saved_modules(setup.architecture, setup.lora_modules_to_save, setup.lora_targets)


def largest_trainable(arch: ModelArchitecture, rank: int, targets: str | tuple[str, ...], saved: SavedModules) -> int:
    """Elements of the largest trained tensor outside the blocks: a saved copy, or the head adapter's lora_B."""
    head_adapter = rank * arch.vocab_size if arch.head_adapted(targets) else 0
    return max(saved.embedding, saved.head, head_adapter)


def head_backward_bytes(arch: ModelArchitecture, compute: int, tokens: int, saved: SavedModules) -> float:
    """The transients of the trained head copy's backward, beyond what lives through it: the matmul's
    backward holds the logits' gradient (compute dtype) and makes the weight gradient in the compute
    dtype; then that is cast to fp32 (the `.grad`), both alive for the cast, while the matmul's saved
    compute-dtype cast of the weight (a weight copy until then) is freed: 4 bytes a value more."""
    if not saved.head:
        return 0.0
    weight = arch.vocab_size * arch.hidden_size
    return max(compute * arch.vocab_size * tokens + compute * weight, 4 * weight)


def saved_per_token(arch: ModelArchitecture, compute: int, saved: SavedModules, rank: int,
                    targets: str | tuple[str, ...], dropout: bool) -> float:
    """Bytes per token autograd saves outside the blocks for what trains there: the input of a trained
    head copy (for its weight gradient), and the head adapter's input to lora_A (a compute-dtype copy:
    peft casts it to the adapter's fp32 and autocast back; with dropout the dropped copy and its mask)
    and x A (for lora_B)."""
    hidden = arch.hidden_size
    total = compute * hidden if saved.head else 0.0
    if arch.head_adapted(targets):
        total += compute * hidden + compute * rank + (hidden if dropout else 0)
    return total

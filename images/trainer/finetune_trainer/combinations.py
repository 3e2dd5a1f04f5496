"""What combines with what: the one home of the rules between training choices.

Every part that decides or checks a training setup asks this module: the FineTuneJob
API (its pydantic validators, and the CEL rules of the CRD generated from `RULES`), the
memory model's `TrainingSetup`, the trainer's `TrainerConfig`, the planner (which
enumerates only what `allows` accepts) and the recovery ladder (which asks the planner).
Pure Python, no pydantic, no torch: the trainer and the operator both import it.

A rule names a combination that cannot run: it is broken when *every* field it reads
has a value in the rule's set. A field that is not decided yet (`None`: `auto` in the
API, a value the planner will choose) breaks nothing; the planner checks again once it
has chosen. Each rule blames one field (the one to change) and says why in words a user
reads; the API prefixes the field's path.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any, Iterable, Mapping

from .memory_levers import LEVERS
from .memory_levers.fields import lever_choices_class
from . import optimizers
from .rules import OFFLOADING, ZERO, AtLeast, Rule
from .rules import one_of as _set

METHODS = ("full", "lora", "qlora")
PRECISIONS = ("bf16", "fp16", "fp32")
OPTIMIZERS = optimizers.NAMES  # optimizers.KINDS: the one list
ATTENTIONS = ("sdpa", "flash", "eager")
STRATEGIES = ("ddp", "fsdp", "zero1", "zero2", "zero3")
OFFLOADS = ("none", "optimizer", "optimizer+params")
# What the job leaves behind (export.py): the adapter as trained, the base with the adapter merged
# into it, or full fine-tuning's weights.
EXPORTS = ("adapter", "merged", "full")


@dataclass(frozen=True)
class _ChoicesHead:
    """The choices of one training setup but the memory levers' (`Choices`)."""

    method: str | None = None
    strategy: str | None = None
    offload: str | None = None
    optimizer: str | None = None
    precision: str | None = None
    gradient_accumulation: int | None = None
    gradient_clipping: bool | None = None  # clipping by global norm (max_grad_norm > 0)
    gradient_checkpointing: bool | None = None
    target_experts: bool | None = None  # LoRA on the fused 3-D expert weights
    modules_to_save: bool | None = None  # lora.modulesToSave names modules trained in full beside the adapters
    moe: bool | None = None  # whether the model has mixture-of-experts layers
    logit_transform: bool | None = None  # the model changes logits after the head (soft-capping, scales)
    export: str | None = None  # what the job exports after training (EXPORTS)

    def but(self, **changes: Any) -> "Choices":
        return replace(self, **changes)


# The memory levers' fields (master_weights ... chunked_loss: what each lever's `choice_values`
# decides) come from the registry, after the others (memory_levers/fields.py).
_ChoicesLevers = lever_choices_class(_ChoicesHead, LEVERS)


@dataclass(frozen=True)
class Choices(_ChoicesLevers):
    """The choices of one training setup; `None` means not decided yet (`auto`)."""


RULES: tuple[Rule, ...] = (
    # ---- strategy x offload -----------------------------------------------------------
    Rule("ddp-offload", {"strategy": _set("ddp"), "offload": OFFLOADING}, "offload",
         "offload needs a sharded strategy (fsdp, zero1-3); ddp keeps full copies on every GPU"),
    Rule("zero12-param-offload", {"offload": _set("optimizer+params"), "strategy": _set("zero1", "zero2")}, "offload",
         "offloading parameters needs fsdp or zero3"),
    Rule("fsdp-optimizer-offload", {"strategy": _set("fsdp"), "offload": _set("optimizer")}, "offload",
         "fsdp offloads parameters together with the optimizer: use optimizer+params"),
    # ---- method -------------------------------------------------------------------------
    Rule("qlora-zero12", {"method": _set("qlora"), "strategy": _set("zero1", "zero2")}, "strategy",
         "qlora runs with ddp, fsdp (it shards the 4-bit base, as fsdp_qlora does) or zero3 (it partitions the"
         " 4-bit base stored in the compute dtype, as peft's ZeRO-3 QLoRA recipe does); zero1 and zero2 are not"
         " run with bitsandbytes' 4-bit weights here"),
    Rule("qlora-fp32", {"method": _set("qlora"), "precision": _set("fp32")}, "precision",
         "qlora computes in bf16 or fp16; fp32 is not allowed"),
    # ---- precision / optimizer x strategy ---------------------------------------------
    Rule("fsdp-fp16", {"strategy": _set("fsdp"), "precision": _set("fp16")}, "precision",
         "strategy fsdp computes in bf16 (or fp32), not fp16"),
    # ---- the optimizers' own (optimizers.py states them) ---------------------------------
    *optimizers.RULES,
    # ---- the memory levers' own (each lever's module states them) ------------------------
    *(rule for lever in LEVERS for rule in lever.rules),
    # ---- LoRA on experts -----------------------------------------------------------------------
    Rule("experts-full", {"target_experts": _set(True), "method": _set("full")}, "target_experts",
         "targetExperts adds adapters: it needs method lora or qlora"),
    Rule("experts-dense", {"target_experts": _set(True), "moe": _set(False)}, "target_experts",
         "the model has no mixture-of-experts layers to adapt"),
    # ---- modules trained in full beside the adapters ---------------------------------------------
    Rule("saved-modules-sharded", {"modules_to_save": _set(True), "strategy": _set("fsdp", "zero3")}, "strategy",
         "lora.modulesToSave runs with ddp, zero1 or zero2: peft trains a copy of each saved module, and neither "
         "FSDP's sharded modules (they cannot be copied) nor ZeRO-3's partitioned parameters load that copy"),
    # ---- export -------------------------------------------------------------------------------
    Rule("merged-full", {"export": _set("merged"), "method": _set("full")}, "export",
         "merged merges a LoRA adapter into the base: it needs method lora or qlora (full fine-tuning exports "
         "its weights: use full)"),
    Rule("full-adapter", {"export": _set("full"), "method": _set("lora", "qlora")}, "export",
         "full exports full fine-tuning's weights: it needs method full (a lora or qlora job exports its "
         "adapter, or merged)"),
)


@dataclass(frozen=True)
class Violation:
    rule: str
    field: str
    message: str


def violations(choices: Choices) -> list[Violation]:
    """The rules `choices` breaks (empty: it can run, as far as what is decided goes)."""
    return [Violation(r.name, r.blame, r.message) for r in RULES if r.broken_by(choices)]


def allows(choices: Choices) -> bool:
    return not any(r.broken_by(choices) for r in RULES)


def first_violation(choices: Choices) -> Violation | None:
    for r in RULES:
        if r.broken_by(choices):
            return Violation(r.name, r.blame, r.message)
    return None


# ---- what a planner may enumerate ------------------------------------------------------------


def offloads_for(strategy: str, method: str | None = None) -> tuple[str, ...]:
    """The offload settings `strategy` can run with (the planner's enumeration)."""
    return tuple(o for o in OFFLOADS if allows(Choices(strategy=strategy, offload=o, method=method)))


def strategies_for(method: str, precision: str | None = None, optimizer: str | None = None) -> tuple[str, ...]:
    """The strategies a method can run with, given the precision and optimizer when known."""
    return tuple(s for s in STRATEGIES
                 if allows(Choices(method=method, strategy=s, precision=precision, optimizer=optimizer)))


# ---- CEL, for the CRD ------------------------------------------------------------------------------


def _cel_literal(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    return "'" + str(value).replace("'", "\\'") + "'"


def cel_rules(paths: Mapping[str, str], *, spelled: Mapping[str, Mapping[Any, Any]] | None = None,
              listed: Mapping[str, str] | None = None) -> list[dict[str, str]]:
    """The rules as CRD `x-kubernetes-validations` of the object whose fields `paths` names.

    `paths` maps a Choices field to its dotted path below `self` (e.g. "resources.offload").
    Rules that read a field the object does not have (gradient accumulation, which the API
    derives) or a numeric condition are left to the pydantic validator. `spelled` maps
    a field's values to the API's spelling where they differ. `listed` maps a boolean Choices
    field that says whether a list is non-empty (modules_to_save) to that list's path.
    """
    spelled, listed = spelled or {}, listed or {}
    rules: list[dict[str, str]] = []
    for rule in RULES:
        if any((name not in paths and name not in listed) or isinstance(values, AtLeast)
               or (name in listed and set(values) != {True}) for name, values in rule.when.items()):
            continue
        terms = []
        for name, values in rule.when.items():
            path = listed.get(name) or paths[name]
            guards = []
            parts = path.split(".")
            for i in range(len(parts)):
                guards.append(f"has(self.{'.'.join(parts[:i + 1])})")
            if name in listed:
                terms.append("(" + " && ".join(guards) + f" && size(self.{path}) > 0)")
                continue
            spell = spelled.get(name, {})
            literals = ", ".join(_cel_literal(spell.get(v, v)) for v in sorted(values, key=str))
            terms.append("(" + " && ".join(guards) + f" && self.{path} in [{literals}])")
        rules.append({
            "rule": "!(" + " && ".join(terms) + ")",
            "message": rule.message,
            "fieldPath": "." + paths[rule.blame],
        })
    return rules


def choice_fields() -> tuple[str, ...]:
    return tuple(f.name for f in fields(Choices))


def describe(violations_: Iterable[Violation]) -> str:
    return "; ".join(f"{v.field}: {v.message}" for v in violations_)

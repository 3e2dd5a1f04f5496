"""What one memory lever is: the fields it owns and what each part of the operator asks of it.

A lever is a plain `Lever` instance in a module of its own (this package's other modules),
listed once in `__init__.LEVERS`. The parts that deal with levers (planner, sizing, recovery,
plan wording, the trainer config) loop over that list and ask the lever; none of them names
one. Pure Python and pydantic (no torch): the trainer and the operator both import it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

from ..rules import Rule

# A lever's setting as one planner setting reads it: its fields and their values
# (the master weights lever: {"master_weights": "bf16", "update_rounding": "stochastic"}).
Setting = Mapping[str, Any]


@dataclass(frozen=True)
class LeverField:
    """One field a lever owns, as a schema declares it: the plan status (`Lever.schema`,
    `fields.lever_fields_model`) or spec.training (`Lever.spec`, `fields.lever_spec_model`)."""

    type: Any
    """Its type there, constraints included (`Literal["fp32", "bf16"]`, `Annotated[int, Field(ge=1)]`,
    `AutoOrInt(1, 64, ...)`)."""
    doc: str
    """Its description there (and so in the CRD), written as an attribute docstring is: the
    builders clean it as pydantic cleans one (`inspect.cleandoc`)."""


@dataclass(frozen=True)
class AutoOrInt:
    """A spec field's type: `auto` or an integer from `minimum` to `maximum` (`what` names the
    integer in the error message: "number of loss chunks").

    Only declared here: the operator's api/schema.py `auto_or_int` makes it the pydantic type and
    the CRD's int-or-string with its CEL rule, as for its other `auto`-or-integer fields. That
    spelling is Kubernetes' (x-kubernetes-int-or-string, CEL, the CRD generator's keys), which the
    trainer has no use for and cannot import from the operator; a plain description keeps it there,
    in one place, rather than moving the CRD's vocabulary into the trainer package."""

    minimum: int
    maximum: int
    what: str


def _no_words(values: Setting) -> str:
    return ""


def switch_ask(value: bool | None) -> tuple[tuple[bool, ...], bool]:
    """An on/off lever's freedom: unset, the planner tries off and on; set, that value (the job's)."""
    if value is None:
        return (False, True), False
    return (value,), True


def same_names(setting: Setting) -> dict[str, Any]:
    """The combinations.Choices fields of a setting whose fields Choices reads under their own names."""
    return dict(setting)


@dataclass(frozen=True)
class Lever:
    """One memory lever of a lean trainer (issue 13)."""

    # ---- its fields ------------------------------------------------------------------------
    name: str
    """Its field in the API (camelCase there), TrainingSetup, the Plan, the plan status and the
    trainer config (see `choice_values` for how combinations.Choices reads it)."""
    off: Mapping[str, Any]
    """Every field the lever owns, with the value that turns it off (the schemas' defaults); the
    first is `name`, others go with it (bf16 master weights: update_rounding)."""
    auto: Mapping[str, Any]
    """What each of its fields reads in spec.training when the job leaves it to the planner."""
    schema: Mapping[str, LeverField]
    """Each of its fields (the keys of `off`, in that order) as the plan status declares it."""
    spec: Mapping[str, LeverField]
    """Each of its fields (the keys of `off`, in that order) as spec.training declares it, where
    the job sets it; its default there is its `auto` value."""
    # ---- planner freedom and ranking ------------------------------------------------------
    ask: Callable[[Any, str, bool], tuple[tuple[Setting, ...] | Any, bool]]
    """(spec.training, method, the model transforms its logits) -> (what the job allows, fixed):
    the hashable freedom `settings` expands, and whether the job set the lever itself."""
    settings: Callable[[Any, Any], tuple[Setting, ...]] | None = None
    """(the freedom `ask` gave, the group's combinations.Choices) -> the settings the planner tries;
    None: the freedom is the values of the lever's one field."""
    choice_values: Callable[[Setting], dict[str, Any]] = same_names
    """A setting (None where not decided yet) as the combinations.Choices fields it decides."""
    rules: tuple[Rule, ...] = ()
    """Its combination rules: combinations.RULES lists them (the API's validators and the CRD's CEL,
    the trainer config, the memory model and the planner all ask that table)."""
    quality_cost: int = 0
    """What the lever gives up when in use, for the tie-break between plans of equal cost
    (higher: worse)."""
    whole_batch: bool = False
    """In use, the lever needs gradient accumulation 1 (one micro-batch of the whole per-GPU batch)."""
    stops_clipping: bool = False
    """In use, the lever rules out gradient clipping by global norm (the trainer's maxGradNorm is 0)."""
    host_memory: bool = False
    """In use, the lever keeps state in host memory: after a host OOM recovery may turn it off."""
    host_transfer_bytes: Callable[[Any, int, int], float] | None = None
    """(architecture, micro-batch, sequence length) -> bytes it moves over PCIe per micro-batch in
    use, which the planner prices as time."""
    last_resort: bool = False
    """Whether the planner tries its settings other than off only when no plan fits without them (the
    job's `auto`): a lever that costs every step time and is worth it only to fit (sequence parallelism)."""
    ranks_per_replica: Callable[[Setting], int] | None = None
    """A setting in use as the number of GPUs that run one micro-batch together (sequence parallelism:
    its degree). The GPU count must be a multiple of it; the data-parallel size is the GPU count divided
    by it, and gradient accumulation is multiplied by it. None: each GPU runs its own micro-batches."""
    traced_by_profile: bool = False
    """Whether the pre-flight profile can size it in use (otherwise only its off setting)."""
    replaces: tuple[str, ...] = ()
    """The levers whose work this one does in use (Liger's fused loss chunks the head and the loss
    itself, so the chunked loss has nothing left to do): the planner and the sizing of a job turn
    them off with it. A job that sets both is refused by a rule of this lever's."""
    # ---- sizing a job as it stands --------------------------------------------------------
    sized: Callable[[Any, str, Any, list], dict[str, Any]] | None = None
    """(spec.training, method, architecture, notes) -> its TrainingSetup fields for `estimate`, a
    note appended for each `auto` sized plainly; None: its one field as the job sets it, off (with a
    note) when left to the planner."""
    # ---- recovery ---------------------------------------------------------------------------
    rung: str | None = None
    """Its rung in spec.recovery.allowedAdjustments; None: recovery never frees it."""
    rung_after: str | None = None
    """The rung it follows in the ladder (recovery tries the cheap changes first)."""
    keeps_explicit: bool = False
    """Its rung frees it only where the job left it `auto`: a value the job set is kept (a lever
    that costs result quality)."""
    # ---- the trainer -----------------------------------------------------------------------------
    needs_cuda: str = ""
    """What of it runs only on CUDA, as a sentence's subject ("Liger's Triton kernels"): in use, the
    trainer refuses it on a node that shows no GPU, naming the field (a ConfigError before anything
    loads, not a crash); "": it runs anywhere."""
    package: str = ""
    """The Python package (its import name) the trainer needs for it in use, which the trainer
    checks before anything loads; "": nothing beyond the trainer's own."""
    trainer_arguments: Callable[[Setting], dict[str, Any]] | None = None
    """A setting in use as the transformers TrainingArguments keywords that turn it on, where the
    Trainer acts on the lever itself (Liger's kernels); None: the trainer's own code does (the
    lever's module says where)."""
    # ---- words ----------------------------------------------------------------------------------
    label: str = ""
    """Its name in `plan` output and lists: "activation offloading"."""
    phrase: str = ""
    """Its name inside a sentence: "the chunked loss"."""
    words: Callable[[Setting], str] = _no_words
    """A setting in use as the plan's summary and reasons read it ("loss in 8 chunks")."""
    in_reasons: bool = True
    """Whether the planner's reasons name it (the chunked loss is the same loss, on by default)."""
    change: str = ""
    """How a plan's list of changes names it when it turns it on unasked ("" : never a change)."""
    describe_change: Callable[[Setting, Setting], str] | None = None
    """(the failed plan's setting, the next one's) -> what recovery changed, for a person ("": no
    change); None: an on/off lever, "turned on <phrase>"."""

    def setting_of(self, values: Any) -> dict[str, Any]:
        """Its fields read off anything that has them as attributes (a Plan, a status, a setup)."""
        return {field: getattr(values, field) for field in self.off}

    def in_use(self, values: Any) -> bool:
        return getattr(values, self.name) != self.off[self.name]

    def settings_for(self, freedom: Any, base: Any) -> tuple[Setting, ...]:
        """The settings the planner tries (`settings`)."""
        if self.settings is not None:
            return self.settings(freedom, base)
        return tuple({self.name: value} for value in freedom)

    def sized_for(self, training: Any, method: str, arch: Any, notes: list) -> dict[str, Any]:
        """Its TrainingSetup fields for sizing a job as it stands (`sized`)."""
        if self.sized is not None:
            return self.sized(training, method, arch, notes)
        value = getattr(training, self.name)
        if value == self.auto[self.name]:
            value = self.off[self.name]
            notes.append(f"training.{camel(self.name)} is unset: sized without {self.phrase}")
        return {self.name: value}

    def change_between(self, old: Setting, new: Setting) -> str:
        """What recovery changed of this lever ("": nothing; `describe_change`)."""
        if self.describe_change is not None:
            return self.describe_change(old, new)
        if new == old:
            return ""
        return "turned " + ("on" if new[self.name] != self.off[self.name] else "off") + f" {self.phrase}"


def camel(name: str) -> str:
    """A lever field as the API, the plan status and the trainer config spell it."""
    head, *rest = name.split("_")
    return head + "".join(part.title() for part in rest)

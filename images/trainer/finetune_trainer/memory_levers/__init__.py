"""The registry of memory levers: each lever is one `Lever` in a module of its own, listed here.

Everything that deals with levers loops over `LEVERS` and asks the lever (lever.py says what a
lever answers): the planner's freedoms and ranking (`lever_ask`, `lever_options`,
`Levers.quality_cost`), what each saves (`savings`), the recovery ladder's rungs (`ladder`),
the plan's words, the sizing of a job as it stands, the TrainingArguments a lever sets
(`trainer_arguments`), and the lever fields of every schema that holds them (`Levers` below;
fields.py for spec.training, the plan status, the Plan, the trainer config, combinations.Choices
and TrainingSetup). Adding a lever is a new module and its line in `LEVERS`, plus its memory term
in the memory model (and the trainer's code for it, unless TrainingArguments turn it on).

Kubeflow Trainer registers its runtime plugins in one place and Kueue its job integrations; this
is the same idea at the size of six levers: a plain tuple of plain dataclass instances.
"""

from __future__ import annotations

from collections import namedtuple
from itertools import product
from typing import Any, Callable, Iterable, NamedTuple, Sequence

from . import activation_offloading, liger_kernel, loss_chunks, master_weights, optimizer_in_backward, sequence_parallel
from .fields import lever_fields_model, lever_setup_class, lever_spec_model, lever_value_checks
from .lever import AutoOrInt, Lever, LeverField, Setting, camel
from .sequence_parallel import attention_refusal

# In the order the plan's words and its list of savings name them.
LEVERS: tuple[Lever, ...] = (
    master_weights.LEVER,
    optimizer_in_backward.LEVER,
    loss_chunks.LEVER,
    activation_offloading.LEVER,
    liger_kernel.LEVER,
    sequence_parallel.LEVER,
)
BY_NAME: dict[str, Lever] = {lever.name: lever for lever in LEVERS}


# One setting of every lever, as a tuple: the fields the levers own (`Lever.off`), in `LEVERS`
# order, each defaulting to its off value. Built from the registry (a class body cannot loop over
# it), as collections.namedtuple builds any tuple class; `Levers` below adds the methods.
_LeverFields = namedtuple("_LeverFields", [field for lever in LEVERS for field in lever.off],
                          defaults=[off for lever in LEVERS for off in lever.off.values()])


class Levers(_LeverFields):
    """One setting of every lever: the fields the levers own (`Lever.off`), in `LEVERS` order, with
    their off values; the TrainingSetup, Plan, plan status and TrainerConfig fields of the same names."""

    __slots__ = ()

    def setup_fields(self) -> dict[str, Any]:
        return self._asdict()

    @property
    def quality_cost(self) -> int:
        """What this setting gives up, for the tie-break between plans of equal cost (higher: worse)."""
        return sum(lever.quality_cost for lever in LEVERS if lever.in_use(self))

    def words(self, chunks: bool = True) -> list[str]:
        """The levers in use, as a person reads them (`chunks`: name the chunked loss too; the
        planner's reasons leave out levers that change nothing of the run, `Lever.in_reasons`)."""
        return [lever.words(lever.setting_of(self)) for lever in LEVERS
                if lever.in_use(self) and (chunks or lever.in_reasons)]


NO_LEVERS = Levers()
if any(tuple(lever.off)[0] != lever.name for lever in LEVERS):
    raise AssertionError("each lever's first field (`off`) must be its name")
if any(tuple(lever.schema) != tuple(lever.off) for lever in LEVERS):
    raise AssertionError("each lever's schema must declare exactly its fields (`off`), in that order")
if any(tuple(lever.spec) != tuple(lever.off) or tuple(lever.auto) != tuple(lever.off) for lever in LEVERS):
    raise AssertionError("each lever's spec and auto must declare exactly its fields (`off`), in that order")


def levers_of(values: Any) -> Levers:
    """The lever setting of anything that has the levers' fields (a Plan, a plan status, a setup)."""
    return Levers(*(getattr(values, field) for field in Levers._fields))


def in_use(values: Any) -> tuple[str, ...]:
    """The names of the levers `values` (a setup, a plan) has on."""
    return tuple(lever.name for lever in LEVERS if lever.in_use(values))


# ---- what the job allows, what the planner tries ------------------------------------------------


class LeverAsk(NamedTuple):
    """What a job allows of each lever (`Lever.ask`'s freedom, in `LEVERS` order; empty: every lever
    off), and which levers the job sets itself (so a plan that uses them changes nothing)."""

    freedoms: tuple = ()
    fixed: frozenset = frozenset()

    def first_resort(self) -> "LeverAsk | None":
        """The ask with each `Lever.last_resort` lever the job left free held at its off value (the
        planner's first search), or None when no such lever is free (one search is all there is)."""
        if not self.freedoms:
            return None
        held, changed = [], False
        for lever, freedom in zip(LEVERS, self.freedoms):
            off = lever.off[lever.name]
            if lever.last_resort and lever.settings is None and off in freedom and len(freedom) > 1:
                held.append((off,))
                changed = True
            else:
                held.append(freedom)
        return self._replace(freedoms=tuple(held)) if changed else None


def lever_ask(training: Any, method: str, logit_transform: bool) -> LeverAsk:
    """The lever freedoms of a spec.training (api.TrainingSpec) for `method`."""
    freedoms, fixed = [], set()
    for lever in LEVERS:
        freedom, by_job = lever.ask(training, method, logit_transform)
        freedoms.append(freedom)
        if by_job:
            fixed.add(lever.name)
    return LeverAsk(tuple(freedoms), frozenset(fixed))


def choice_values(values: Any, *, auto_is_none: bool = False) -> dict[str, Any]:
    """The combinations.Choices fields the levers decide, read off `values` (a setup, a config;
    `auto_is_none`: a spec.training, whose `auto`/unset fields are not decided yet)."""
    found: dict[str, Any] = {}
    for lever in LEVERS:
        setting = lever.setting_of(values)
        if auto_is_none:
            setting = {f: None if v == lever.auto[f] else v for f, v in setting.items()}
        found.update(lever.choice_values(setting))
    return found


def lever_options(ask: LeverAsk, base: Any, *, accumulation_one: bool,
                  allows: Callable[[Any], bool]) -> tuple[Levers, ...]:
    """Every lever setting the job allows with `base` (a combinations.Choices of the method,
    strategy, offload, optimizer, precision, checkpointing...) that `allows` accepts.
    `accumulation_one`: whether the group can run with gradient accumulation 1 (`Lever.whole_batch`)."""
    per_lever = [lever.settings_for(freedom, base) for lever, freedom in zip(LEVERS, ask.freedoms)] if ask.freedoms \
        else [(dict(lever.off),) for lever in LEVERS]
    found: dict[Levers, None] = {}  # in order, once each (a replaced lever's settings fall together)
    for settings in product(*per_lever):
        settings = _replaced_off(settings)
        fields: dict[str, Any] = {}
        choices: dict[str, Any] = {}
        whole = clipping_off = False
        for lever, setting in zip(LEVERS, settings):
            fields.update(setting)
            choices.update(lever.choice_values(setting))
            on = setting[lever.name] != lever.off[lever.name]
            whole |= on and lever.whole_batch
            clipping_off |= on and lever.stops_clipping
        if whole and not accumulation_one:
            continue
        if whole:
            choices["gradient_accumulation"] = 1
        if clipping_off:
            choices["gradient_clipping"] = False
        if allows(base.but(**choices)):
            found[Levers(**fields)] = None
    return tuple(found)


def _replaced(settings: Sequence[Setting]) -> dict[str, Lever]:
    """The levers that a lever in use in `settings` (one per lever, in `LEVERS` order) replaces
    (`Lever.replaces`), each with the lever that replaces it."""
    return {name: lever for lever, setting in zip(LEVERS, settings)
            if setting[lever.name] != lever.off[lever.name] for name in lever.replaces}


def _replaced_off(settings: Sequence[Setting]) -> tuple[Setting, ...]:
    """`settings` with every lever that a lever in use replaces turned off."""
    replaced = _replaced(settings)
    return tuple(dict(lever.off) if lever.name in replaced else setting for lever, setting in zip(LEVERS, settings))


def ranks_per_replica(values: Any) -> int:
    """How many GPUs run one micro-batch together under the levers `values` (a setup, a plan, a
    config) has on (`Lever.ranks_per_replica`): 1 unless a lever splits the micro-batch's sequence.
    The data-parallel size is the GPU count divided by it."""
    ranks = 1
    for lever in LEVERS:
        if lever.ranks_per_replica is not None and lever.in_use(values):
            ranks *= lever.ranks_per_replica(lever.setting_of(values))
    return ranks


def unsplit(levers: Levers) -> Levers:
    """`levers` with every lever that splits a micro-batch over GPUs (`Lever.ranks_per_replica`) off:
    how evaluation runs (the trainer evaluates each rank's sequences whole)."""
    return levers._replace(**{field: value for lever in LEVERS if lever.ranks_per_replica is not None
                              for field, value in lever.off.items()})


def eval_micro_batch(named: int | None, training_micro: int | None, values: Any) -> int | None:
    """The micro-batch evaluation runs at: the job's evaluation.microBatchSize when named; else, where
    `values` (a config, a plan's levers) split sequences over GPUs, 1 (evaluation runs each sequence
    whole); else the training micro-batch. The trainer runs it, the planner sizes it."""
    if named is not None:
        return named
    return 1 if ranks_per_replica(values) > 1 else training_micro


def needs_whole_batch(levers: Levers) -> bool:
    """Whether `levers` needs gradient accumulation 1."""
    return any(lever.whole_batch and lever.in_use(levers) for lever in LEVERS)


def stops_clipping(levers: Any) -> bool:
    """Whether `levers` (or a plan) rules out gradient clipping by global norm."""
    return any(lever.stops_clipping and lever.in_use(levers) for lever in LEVERS)


def lever_changes(levers: Levers, fixed: frozenset) -> tuple[str, ...]:
    """The levers a plan turns on that the job did not ask for (`Lever.change`; the chunked loss
    changes nothing)."""
    return tuple(lever.change for lever in LEVERS
                 if lever.change and lever.in_use(levers) and lever.name not in fixed)


# ---- what each lever saves ----------------------------------------------------------------------


def savings(levers: Levers, own_required: int, required: Callable[[Levers], "int | None"]) -> dict[str, int]:
    """Per-GPU required bytes each lever in use saves: what `required` says of the setting with that
    lever alone turned off, less `own_required`; 0 when the setup cannot run without it (`required`
    gives None: e.g. bf16 master weights under rules that need them; the lever is reported, its
    saving unknown)."""
    found: dict[str, int] = {}
    for lever in LEVERS:
        if not lever.in_use(levers):
            continue
        without = required(levers._replace(**lever.off))
        found[lever.name] = 0 if without is None else max(0, int(without - own_required))
    return found


# ---- recovery -------------------------------------------------------------------------------------


def ladder(rungs: Sequence[str]) -> tuple[str, ...]:
    """The recovery ladder's rung names: `rungs` (those of the other adjustments, in order) with
    each lever's rung right after the rung it names (`Lever.rung_after`)."""
    out: list[str] = []
    for rung in rungs:
        out.append(rung)
        out.extend(lever.rung for lever in LEVERS if lever.rung is not None and lever.rung_after == rung)
    placed = set(out)
    lost = [lever.name for lever in LEVERS if lever.rung is not None and lever.rung not in placed]
    if lost:
        raise AssertionError(f"levers whose rung follows no rung of the ladder: {', '.join(lost)}")
    return tuple(out)


def by_rung(order: Iterable[str]) -> tuple[Lever, ...]:
    """The levers with a rung, in the order of `order` (the ladder's rung names)."""
    return tuple(lever for rung in order for lever in LEVERS if lever.rung == rung)


def sized_fields(training: Any, method: str, arch: Any, notes: list) -> dict[str, Any]:
    """The TrainingSetup fields of the levers for sizing a job as it stands (`Lever.sized`; a lever
    that a lever in use replaces is off, with a note)."""
    settings = [lever.sized_for(training, method, arch, notes) for lever in LEVERS]
    replaced = _replaced(settings)
    found: dict[str, Any] = {}
    for lever, setting in zip(LEVERS, settings):
        if lever.name in replaced:
            setting = dict(lever.off)
            notes.append(f"training.{camel(lever.name)}: off (replaced by {replaced[lever.name].phrase})")
        found.update(setting)
    return found


def trainer_arguments(values: Any) -> dict[str, Any]:
    """The transformers TrainingArguments keywords of the levers `values` (a trainer config) has on
    (`Lever.trainer_arguments`)."""
    found: dict[str, Any] = {}
    for lever in LEVERS:
        if lever.trainer_arguments is not None and lever.in_use(values):
            found.update(lever.trainer_arguments(lever.setting_of(values)))
    return found


def derived_choices() -> frozenset[str]:
    """The combinations.Choices fields a lever decides that are none of its own fields but follow
    from one (`chunked_loss`: whether lossChunks > 1): the API field's values are not theirs, so a
    CEL rule cannot test them (their rules stay with the API's validator)."""
    return frozenset(choice for lever in LEVERS for choice in lever.choice_values(dict(lever.off))
                     if choice not in lever.off)


def config_fields() -> dict[str, str]:
    """The combinations.Choices fields the levers decide, by the config/API field they come from
    (camelCase): for error messages that name the field a person sets."""
    found: dict[str, str] = {}
    for lever in LEVERS:
        for choice in lever.choice_values(dict(lever.off)):
            found[choice] = camel(choice if choice in lever.off else lever.name)
    return found


__all__ = [
    "AutoOrInt",
    "BY_NAME",
    "LEVERS",
    "Lever",
    "LeverField",
    "LeverAsk",
    "Levers",
    "NO_LEVERS",
    "Setting",
    "by_rung",
    "camel",
    "choice_values",
    "config_fields",
    "derived_choices",
    "in_use",
    "ladder",
    "lever_ask",
    "lever_changes",
    "lever_options",
    "lever_fields_model",
    "lever_setup_class",
    "lever_spec_model",
    "lever_value_checks",
    "levers_of",
    "needs_whole_batch",
    "ranks_per_replica",
    "savings",
    "sized_fields",
    "stops_clipping",
    "trainer_arguments",
    "unsplit",
    "eval_micro_batch",
    "attention_refusal",
]

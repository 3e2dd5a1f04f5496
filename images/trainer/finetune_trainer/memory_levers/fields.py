"""The levers' fields as the fields of the schemas that hold them, built from the registry: the
plan status, the Plan and the trainer config (each lever's `schema`, off by default), spec.training
(its `spec`, `auto` by default), combinations.Choices (what its `choice_values` decides, None:
not decided yet) and the memory model's TrainingSetup (its `schema` type, off by default).

`pydantic.create_model` and `dataclasses.make_dataclass` are used because the field list is data
(the registry), not source: a class body cannot loop over `LEVERS`. Each schema names its own
fields before the levers' in a base class, builds the levers' class on it, and adds the rest in a
subclass, so the field order (and the CRD generated from it) is what it was when the fields were
written by hand.
"""

from __future__ import annotations

from dataclasses import make_dataclass
from inspect import cleandoc
from typing import Any, Callable

from pydantic import BaseModel, Field, TypeAdapter, ValidationError, create_model

from .lever import Lever, LeverField


def _model(base: type[BaseModel], fields: dict[str, tuple[LeverField, Any]], type_of: Callable[[Any], Any]) -> Any:
    # cleandoc: the description pydantic would take from the same text as an attribute docstring.
    declared = {name: (type_of(field.type), Field(default, description=cleandoc(field.doc)))
                for name, (field, default) in fields.items()}
    return create_model(f"{base.__name__}Levers", __base__=base, __module__=base.__module__, **declared)


def lever_fields_model(base: type[BaseModel], levers: tuple[Lever, ...]) -> Any:
    """A subclass of `base` with every lever's fields as the plan status declares them (`schema`,
    in `levers` order, off by default, documented); `base` brings the aliases and the config."""
    return _model(base, {name: (lever.schema[name], lever.off[name]) for lever in levers for name in lever.off},
                  lambda declared: declared)


def lever_spec_model(base: type[BaseModel], levers: tuple[Lever, ...], type_of: Callable[[Any], Any]) -> Any:
    """A subclass of `base` with every lever's fields as spec.training declares them (`spec`, in
    `levers` order, `auto` by default, documented). `type_of` turns a declared type into the
    pydantic one (the operator's spelling of `AutoOrInt`); `base` brings the aliases and the config."""
    return _model(base, {name: (lever.spec[name], lever.auto[name]) for lever in levers for name in lever.off},
                  type_of)


def lever_choice_names(levers: tuple[Lever, ...]) -> tuple[str, ...]:
    """The combinations.Choices fields the levers decide, in `levers` order (`Lever.choice_values`:
    the chunked loss decides `chunked_loss`, the others their own fields)."""
    return tuple(name for lever in levers for name in lever.choice_values(dict(lever.off)))


def _dataclass(base: type, fields: list[tuple[str, Any, Any]]) -> type:
    return make_dataclass(f"{base.__name__}Levers", fields, bases=(base,), frozen=True,
                          namespace={"__module__": base.__module__})


def lever_choices_class(base: type, levers: tuple[Lever, ...]) -> type:
    """A frozen dataclass on `base` (a frozen dataclass) with the levers' combinations.Choices
    fields after its own, each None (not decided yet) by default."""
    return _dataclass(base, [(name, Any, None) for name in lever_choice_names(levers)])


def lever_setup_class(base: type, levers: tuple[Lever, ...]) -> type:
    """A frozen dataclass on `base` (a frozen dataclass) with every lever's fields after its own,
    typed as the plan status declares them (`schema`) and off by default: the memory model's
    TrainingSetup. A dataclass does not check its types: `lever_value_checks` does."""
    return _dataclass(base, [(name, lever.schema[name].type, lever.off[name]) for lever in levers
                             for name in lever.off])


def lever_value_checks(levers: tuple[Lever, ...]) -> dict[str, Callable[[Any], "str | None"]]:
    """For each lever field, a check of a value against its `schema` type, strictly (no coercion:
    1 is no boolean): what is wrong with the value, in pydantic's words, or None."""
    checks: dict[str, Callable[[Any], str | None]] = {}
    for lever in levers:
        for name, field in lever.schema.items():
            checks[name] = _strict_check(TypeAdapter(field.type))
    return checks


def _strict_check(adapter: TypeAdapter) -> Callable[[Any], "str | None"]:
    def check(value: Any) -> str | None:
        try:
            adapter.validate_python(value, strict=True)
        except ValidationError as error:
            return f"{error.errors()[0]['msg']}, got {value!r}"
        return None
    return check

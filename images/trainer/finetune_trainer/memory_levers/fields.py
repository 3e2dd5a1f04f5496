"""The levers' fields as pydantic fields of the plan status and of spec.training (and so of the
CRD), built from each lever's `schema` and `off` (the status) or `spec` and `auto` (the spec).

`pydantic.create_model` is used because the field list is data (the registry), not source: a
class body cannot loop over `LEVERS`. Each schema names its own fields before the levers' in a
base class, builds the levers' model on it, and adds the rest in a subclass, so the field order
(and the CRD generated from it) is what it was when the fields were written by hand. The Plan and
the trainer config still write their lever fields by hand (issue 25).
"""

from __future__ import annotations

from inspect import cleandoc
from typing import Any, Callable

from pydantic import BaseModel, Field, create_model

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

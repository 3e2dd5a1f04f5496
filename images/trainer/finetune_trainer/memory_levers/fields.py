"""The levers' fields as pydantic fields: one base model per schema that holds a decided setting
(the plan status, the Plan, the trainer config), built from each lever's `schema` and `off`.

`pydantic.create_model` is used because the field list is data (the registry), not source: a
class body cannot loop over `LEVERS`. The schema names its own fields before the levers' in a
base class, builds the levers' model on it, and adds the rest in a subclass, so the field order
(and the CRD generated from it) is what it was when the fields were written by hand.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field, create_model

from .lever import Lever

Role = Literal["status", "plan", "config"]


def _field(lever: Lever, name: str, role: Role) -> tuple[Any, Any]:
    spec = lever.schema[name]
    kind = spec.config_type if role == "config" and spec.config_type is not None else spec.type
    # The plan status documents its fields (the CRD's descriptions); the others keep no docs.
    doc = spec.doc if role == "status" else None
    return kind, Field(lever.off[name], description=doc)


def lever_fields_model(role: Role, base: type[BaseModel], levers: tuple[Lever, ...] | None = None) -> Any:
    """A subclass of `base` with every lever's fields (in `LEVERS` order, off by default) as `role`
    declares them; `base` brings the aliases and the config."""
    if levers is None:
        from . import LEVERS as levers
    fields = {name: _field(lever, name, role) for lever in levers for name in lever.off}
    return create_model(f"{base.__name__}Levers", __base__=base, __module__=base.__module__, **fields)


def lever_field_names(model: type[BaseModel]) -> tuple[str, ...]:
    """The lever fields a model holds, in its order (tests compare them with the registry's)."""
    from . import Levers

    return tuple(name for name in model.model_fields if name in Levers._fields)

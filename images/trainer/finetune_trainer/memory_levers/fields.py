"""The levers' fields as pydantic fields of the plan status (and so of the CRD), built from each
lever's `schema` and `off`.

`pydantic.create_model` is used because the field list is data (the registry), not source: a
class body cannot loop over `LEVERS`. The plan status names its own fields before the levers' in a
base class, builds the levers' model on it, and adds the rest in a subclass, so the field order
(and the CRD generated from it) is what it was when the fields were written by hand. The Plan, the
trainer config and the API's TrainingSpec still write their lever fields by hand (issue 25).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field, create_model

from .lever import Lever


def lever_fields_model(base: type[BaseModel], levers: tuple[Lever, ...]) -> Any:
    """A subclass of `base` with every lever's fields (in `levers` order, off by default, documented);
    `base` brings the aliases and the config."""
    fields = {name: (lever.schema[name].type, Field(lever.off[name], description=lever.schema[name].doc))
              for lever in levers for name in lever.off}
    return create_model(f"{base.__name__}Levers", __base__=base, __module__=base.__module__, **fields)

"""The shape of a combination rule, apart from the table of rules (combinations.py) so that the
memory levers (memory_levers/), whose rules that table lists, can state theirs without importing it.
Pure Python."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

ZERO = frozenset({"zero1", "zero2", "zero3"})
OFFLOADING = frozenset({"optimizer", "optimizer+params"})


def one_of(*values: Any) -> frozenset:
    return frozenset(values)


@dataclass(frozen=True)
class AtLeast:
    """A condition on a number: broken from `minimum` on."""

    minimum: int

    def __contains__(self, value: object) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and value >= self.minimum


@dataclass(frozen=True)
class Rule:
    """A combination that cannot run: every field of `when` has a value in its set."""

    name: str
    when: Mapping[str, frozenset | AtLeast]
    blame: str  # the field to change
    message: str

    def broken_by(self, choices: Any) -> bool:
        for name, values in self.when.items():
            value = getattr(choices, name)
            if value is None or value not in values:
                return False
        return True

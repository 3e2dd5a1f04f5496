"""Kubernetes quantities (`80Gi`, `1e3`, `500m`, `1Ei`) as numbers, with errors that name the field.

The parsing is the kubernetes client's own (`kubernetes.utils.parse_quantity`, which
returns an exact Decimal). Decimal reads more than the API server does, so a few shapes
it would take are refused first: whitespace, `_` digit separators, non-ASCII digits,
infinities and NaN. Every quantity this package reads (memory, CPUs, GPUs) is a size, so
negative ones are refused too, and so are ones beyond an int64.
"""

from __future__ import annotations

import math
from decimal import Decimal

from kubernetes.utils import parse_quantity as _client_parse_quantity

EXAMPLES = "e.g. 80Gi, 2Ti, 1e3, 500m, 192"
# The API server keeps a quantity's value in an int64.
MAX_QUANTITY = 2**63 - 1


class QuantityError(ValueError):
    """A value that is not a usable Kubernetes quantity; the message names the field."""

    def __init__(self, field: str, value: object, why: str) -> None:
        super().__init__(f"{field}: {why}: {value!r} ({EXAMPLES})")
        self.field = field
        self.value = value


def parse_quantity(value: object, field: str = "quantity") -> Decimal:
    """A Kubernetes quantity (`"2113523516Ki"`, `"1800Gi"`, `"1e3"`, `"500m"`, or a number) exactly.

    Raises QuantityError naming `field` for anything else, and for negative quantities.
    """
    if isinstance(value, bool) or not isinstance(value, (str, int, float, Decimal)):
        raise QuantityError(field, value, "not a Kubernetes quantity")
    if isinstance(value, str) and (not value.isascii() or "_" in value or value != "".join(value.split())):
        # Decimal takes "1_000", " 8", Arabic-Indic digits; the API server takes none of them.
        raise QuantityError(field, value, "not a Kubernetes quantity")
    try:
        number = _client_parse_quantity(value)
    except (ValueError, ArithmeticError):
        raise QuantityError(field, value, "not a Kubernetes quantity") from None
    if not number.is_finite():
        raise QuantityError(field, value, "not a Kubernetes quantity")
    if number < 0:
        raise QuantityError(field, value, "must not be negative")
    if number > MAX_QUANTITY:
        # "1e999999999" is a valid Decimal; turned into an int it would exhaust memory.
        raise QuantityError(field, value, "larger than the API server can hold")
    return number


def quantity_bytes(value: object, field: str) -> int:
    """A memory quantity in whole bytes; a fraction of a byte rounds up, as the API server does."""
    return math.ceil(parse_quantity(value, field))


def quantity_count(value: object, field: str) -> int:
    """A count (CPUs, GPUs) in whole units; a fraction rounds down (191500m CPUs: 191 whole CPUs)."""
    return math.floor(parse_quantity(value, field))

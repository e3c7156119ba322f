"""Range checks for configuration and request values: one wording for every such error.

Owns the test that a value is an int or a finite number within bounds, and the message
that says which value was wrong, what was seen, and what would be valid. Knows nothing of
what the values mean: callers pass the name and, where it helps, why the bound exists.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import attrs


def require_int(
    name: str,
    value: object,
    minimum: int = 1,
    *,
    maximum: int | None = None,
    why: str = "",
    optional: bool = False,
) -> None:
    """ValueError unless `value` is an int (not a bool) >= `minimum` and <= `maximum`; None passes when `optional`."""
    if optional and value is None:
        return
    wanted = f"an int >= {minimum}" if maximum is None else f"an int in [{minimum}, {maximum}]"
    if (
        isinstance(value, bool)
        or not isinstance(value, int)
        or value < minimum
        or (maximum is not None and value > maximum)
    ):
        raise ValueError(_message(name, value, wanted + (" or None" if optional else ""), why))


def require_number(
    name: str,
    value: object,
    minimum: float,
    *,
    maximum: float | None = None,
    above: bool = False,
    why: str = "",
) -> None:
    """ValueError unless `value` is a finite int or float >= `minimum` (> when `above`), <= `maximum`."""
    low = f"> {minimum}" if above else f">= {minimum}"
    wanted = f"a finite number {low}" + (f" and <= {maximum}" if maximum is not None else "")
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if ok:
        assert isinstance(value, (int, float))
        ok = (value > minimum if above else value >= minimum) and (maximum is None or value <= maximum)
    if not ok:
        raise ValueError(_message(name, value, wanted, why))


def _message(name: str, value: object, wanted: str, why: str) -> str:
    return f"{name}={value!r} is invalid: it must be {wanted}" + (f" ({why})" if why else "")


def at_least(minimum: float, *, integer: bool) -> Callable[[Any, attrs.Attribute, Any], None]:
    """`require_int` / `require_number` as an attrs field validator (the field's name is the value's)."""

    def check(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
        if integer:
            require_int(attribute.name, value, int(minimum))
        else:
            require_number(attribute.name, value, minimum)

    return check

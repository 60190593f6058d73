"""A config.json's numbers, read strictly: a whole number must be one (never `int('sixty-four')`), a
bool is never a number. A bad value is a SpecError naming the field."""

from __future__ import annotations

from typing import Any

from foundation.errors import SpecError


def as_int(name: str, value: Any) -> int:
    """A config's whole number, or a SpecError naming the field (never `int('sixty-four')`)."""
    if isinstance(value, bool) or not (isinstance(value, int) or isinstance(value, float) and value.is_integer()):
        raise SpecError(name, f"{value!r} is not a whole number")
    return int(value)


def as_float(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise SpecError(name, f"{value!r} is not a number")
    return float(value)


def as_bool(name: str, value: Any) -> bool:
    """A config's true/false, never a number or a string read as one."""
    if not isinstance(value, bool):
        raise SpecError(name, f"{value!r} is not true or false")
    return value

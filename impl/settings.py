"""How a declared setting reads (a pydantic `Field` of `DraftSpec` or `Recipe`): the values it takes, its bounds,
and what is wrong with a value, in the words every message and every help line use."""

from __future__ import annotations

import numbers
import types
from typing import Any, Literal, Union, get_args, get_origin

from pydantic.fields import FieldInfo

BOUND_KEYS = ("gt", "ge", "lt", "le")


def choices(info: FieldInfo) -> tuple[Any, ...]:
    """The values a Literal setting takes (None aside); () for any other."""
    annotation = base_type(info)
    return get_args(annotation) if get_origin(annotation) is Literal else ()


def is_optional(info: FieldInfo) -> bool:
    """Whether the setting may be None (`int | None`)."""
    return type(None) in get_args(info.annotation) and get_origin(info.annotation) in (Union, types.UnionType)


def base_type(info: FieldInfo) -> Any:
    """The declared type without `| None`."""
    if is_optional(info):
        rest = [arg for arg in get_args(info.annotation) if arg is not type(None)]
        return rest[0] if len(rest) == 1 else Union[tuple(rest)]
    return info.annotation


def bounds(info: FieldInfo) -> dict[str, float]:
    """{"gt": 0, "le": 1, ...}: the bounds a field declares."""
    found = {}
    for item in info.metadata:
        for key in BOUND_KEYS:
            if getattr(item, key, None) is not None:
                found[key] = getattr(item, key)
    return found


def bounds_text(info: FieldInfo, integer: bool = False) -> str:
    """The declared range in words: "positive", "non-negative", "in (0, 1]"; for an integer "a positive integer",
    "an integer >= 1" (an upper bound on an integer is a size no real model has: `past_text`)."""
    found = bounds(info)
    if integer:
        low = {key: value for key, value in found.items() if key in ("gt", "ge")}
        return ("a positive integer" if low == {"gt": 0} else f"an integer >= {low['ge']}" if "ge" in low
                else f"an integer > {low['gt']}" if "gt" in low else "an integer")
    if found == {"gt": 0}:
        return "positive"
    if found == {"ge": 0}:
        return "non-negative"
    low = f"({found['gt']:g}" if "gt" in found else f"[{found['ge']:g}" if "ge" in found else "(-inf"
    high = f"{found['lt']:g})" if "lt" in found else f"{found['le']:g}]" if "le" in found else "inf)"
    return f"in {low}, {high}" if found else ""


def _inside(value: float, found: dict[str, float]) -> bool:
    return (("gt" not in found or value > found["gt"]) and ("ge" not in found or value >= found["ge"])
            and ("lt" not in found or value < found["lt"]) and ("le" not in found or value <= found["le"]))


def is_number(value: Any) -> bool:
    """An int or float (numpy's too), not a bool: `true` is no gamma."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def is_integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def value_problem(info: FieldInfo, value: Any) -> str | None:
    """What is wrong with `value` for this declared setting (its kind, its choices, its bounds), or None: the one
    check of a setting's own range, and its message (a rule between settings is its model's own)."""
    optional = is_optional(info)
    if value is None:
        return None if optional else f"must be {kind_text(info)}, got None"
    allowed = choices(info)
    if allowed:
        return None if value in allowed else f"{value!r} not in {list(allowed)}"
    kind = base_type(info)
    found = bounds(info)
    if kind is bool:
        return None if isinstance(value, bool) else f"must be true or false, got {value!r}"
    if kind is int:
        words = bounds_text(info, integer=True)
        if not is_integer(value):
            return f"must be {words}{' or null' if optional and words == 'an integer' else ''}, got {value!r}"
        low = {key: v for key, v in found.items() if key in ("gt", "ge")}
        if not _inside(value, low):
            return f"must be {words}, got {value!r}"
        return None if _inside(value, found) else f"{value} is past any real model's (at most {found['le']:,})"
    if kind is float:
        if not is_number(value):
            return f"must be a number{' or null' if optional else ''}, got {value!r}"
        return None if _inside(value, found) else f"must be {bounds_text(info)}, got {value}"
    if kind is str:
        return None if isinstance(value, str) else f"must be a name, got {value!r}"
    if get_origin(kind) is tuple:
        return None if isinstance(value, (list, tuple)) else f"must be a list, got {value!r}"
    if get_origin(kind) is dict or kind is dict:
        return None if isinstance(value, dict) else f"must be a mapping{' or null' if optional else ''}, got {value!r}"
    return None


def kind_text(info: FieldInfo) -> str:
    """What the setting holds, in words ("a positive integer", "a number", "true or false", ...)."""
    allowed = choices(info)
    if allowed:
        return "one of " + ", ".join(str(choice) for choice in allowed)
    kind = base_type(info)
    if kind is int:
        return bounds_text(info, integer=True)
    if kind is float:
        return "a number"
    if kind is bool:
        return "true or false"
    if kind is str:
        return "a name"
    if get_origin(kind) is tuple:
        return "a list"
    return "a mapping"


def type_name(info: FieldInfo) -> str:
    """The declared type in a table's words: `integer`, `number`, `true/false`, the choices, "... or none"."""
    allowed = choices(info)
    kind = base_type(info)
    name = (" \\| ".join(f"`{c}`" for c in allowed) if allowed else
            {int: "integer", float: "number", bool: "true/false", str: "name"}.get(kind)
            or ("list" if get_origin(kind) is tuple else "mapping"))
    return f"{name} or none" if is_optional(info) else name

"""The declared settings (`DraftSpec`, `Recipe`, a command's `RunSettings`): pydantic validates every value against
its `Field` (kind, choices, bounds), and this module words what pydantic refuses, the one line every refusal, help
line and docs table reads. A rule between settings is its model's own."""

from __future__ import annotations

import types
from functools import cache
from typing import Annotated, Any, ClassVar, Literal, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict, TypeAdapter, ValidationError
from pydantic.fields import FieldInfo
from pydantic_core import ErrorDetails

from foundation.errors import SpecError

# Strict: `true` is no size, "4" no gamma and 3.5 no layer count (an int stands for a float, as JSON writes it).
STRICT = ConfigDict(frozen=True, extra="forbid", strict=True)
# pydantic's JSON-schema words for the four bounds, as a Field declares them.
SCHEMA_BOUNDS = {"exclusiveMinimum": "gt", "minimum": "ge", "exclusiveMaximum": "lt", "maximum": "le"}
BOUND_ERRORS = {"greater_than", "greater_than_equal", "less_than", "less_than_equal"}


class Declared(BaseModel):
    """A model whose values pydantic validates; a refusal is one line naming the field, in `refused`'s error."""

    model_config = STRICT
    SUBJECT: ClassVar[str] = "settings"  # who is named for unknown or missing fields ("spec", "recipe", ...)
    # Sizes and ids say their bound as an integer's ("a positive integer", "at most 16,777,216"); others "positive".
    INTEGER_WORDS: ClassVar[bool] = False

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as exc:
            raise type(self).refusal(exc, data) from None

    @classmethod
    def refused(cls, field_name: str, message: str) -> Exception:
        return SpecError(field_name, message)

    @classmethod
    def refusal(cls, exc: ValidationError, data: dict[str, Any]) -> Exception:
        """The one error to raise for pydantic's refusal: unknown fields first, then missing ones, then the first
        bad value in the order given."""
        errors = exc.errors()
        for kind, words in (("extra_forbidden", "unknown"), ("missing", "missing")):
            names = sorted(str(e["loc"][0]) for e in errors if e["type"] == kind)
            if names:
                return cls.refused(cls.SUBJECT, f"{words} fields {names}")
        first = first_error(exc, data)
        cause = (first.get("ctx") or {}).get("error")
        if isinstance(cause, SpecError):  # a validator's own refusal, already one line naming its field
            return cause
        name = str(first["loc"][0]) if first["loc"] else cls.SUBJECT
        return cls.refused(name, problem(cls, name, first))


def first_error(exc: ValidationError, data: dict[str, Any]) -> ErrorDetails:
    """The refusal of the first bad value in the order given (a rule between settings, which has no field, last)."""
    order = list(data)
    return min(exc.errors(), key=lambda e: order.index(e["loc"][0]) if e["loc"] and e["loc"][0] in order
               else len(order))


def problem(model: type[Declared], name: str, error: ErrorDetails) -> str:
    """pydantic's refusal of one value of the setting `name`, in the tool's words."""
    info, kind, value = model.model_fields[name], error["type"], error["input"]
    if kind in ("value_error", "assertion_error"):
        return str(error["ctx"]["error"])
    if kind == "literal_error":
        return f"{value!r} not in {list(choices(info))}"
    if kind == "finite_number":
        return f"must be a finite number, got {value}"
    if len(error["loc"]) > 1:  # an item of a list
        item = get_args(base_type(info))[0]
        return f"item {error['loc'][1]} must be {KIND_WORDS.get(item, 'valid')}, got {value!r}"
    if kind in BOUND_ERRORS:
        found = declared_range(model, name)
        if base_type(info) is int and model.INTEGER_WORDS:
            if kind.startswith("less"):  # an upper bound on an integer is a size no real model has
                return f"{value} is past any real model's (at most {found['le']:,})"
            return f"must be {integer_words(found)}, got {value}"
        return f"must be {range_words(found)}, got {value}"
    words = kind_text(model, name)
    if is_optional(info) and (words in ("a number", "a mapping", "an integer")):
        words += " or null"
    return f"must be {words}, got {value!r}"


def problem_with(model: type[Declared], name: str, value: Any) -> str | None:
    """What is wrong with `value` for the setting `name` of `model` on its own (kind, choices, bounds), or None;
    pydantic judges it by the field's declaration."""
    if name not in model.model_fields:
        return None
    try:
        _adapter(model, name).validate_python(value)
    except ValidationError as exc:
        return problem(model, name, exc.errors()[0])
    return None


@cache
def _adapter(model: type[Declared], name: str) -> TypeAdapter:
    info = model.model_fields[name]  # its type, bounds, strictness and validators (the rest is the model's)
    declared = Annotated[(info.annotation, *info.metadata)] if info.metadata else info.annotation
    return TypeAdapter(declared, config=ConfigDict(strict=True))


# -- the words --------------------------------------------------------------------------------------------------------
KIND_WORDS = {float: "a number", bool: "true or false", str: "a name", int: "an integer"}


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


@cache
def declared_range(model: type[Declared], name: str) -> dict[str, float]:
    """{"gt": 0, "le": 1, ...}: the setting's bounds, as pydantic's JSON schema of its Field states them."""
    schema = _adapter(model, name).json_schema()
    for option in schema.get("anyOf", [schema]):
        found = {SCHEMA_BOUNDS[key]: value for key, value in option.items() if key in SCHEMA_BOUNDS}
        if found:
            return found
    return {}


def choice_words(allowed: tuple[Any, ...]) -> str:
    """The choices in words: "speculators", "fp32 or bf16", "one of dflash, dflash2, dspark"."""
    names = [str(choice) for choice in allowed]
    return names[0] if len(names) == 1 else " or ".join(names) if len(names) == 2 else "one of " + ", ".join(names)


def integer_words(found: dict[str, float]) -> str:
    """An integer's lower bound in words: "a positive integer", "an integer >= 1"."""
    return ("a positive integer" if found.get("gt") == 0 else f"an integer >= {found['ge']}" if "ge" in found
            else f"an integer > {found['gt']}" if "gt" in found else "an integer")


def range_words(found: dict[str, float]) -> str:
    """A range in words: "positive", "non-negative", "in (0, 1]"; "" for none."""
    if found == {"gt": 0}:
        return "positive"
    if found == {"ge": 0}:
        return "non-negative"
    low = f"({found['gt']:g}" if "gt" in found else f"[{found['ge']:g}" if "ge" in found else "(-inf"
    high = f"{found['lt']:g})" if "lt" in found else f"{found['le']:g}]" if "le" in found else "inf)"
    return f"in {low}, {high}" if found else ""


def range_text(model: type[Declared], name: str) -> str:
    """The setting's declared range, as its refusals say it ("" for none)."""
    found = declared_range(model, name)
    if not found:
        return ""
    return integer_words(found) if base_type(model.model_fields[name]) is int and model.INTEGER_WORDS \
        else range_words(found)


def kind_text(model: type[Declared], name: str) -> str:
    """What the setting holds, in words ("a positive integer", "a number", "true or false", ...)."""
    info = model.model_fields[name]
    allowed = choices(info)
    if allowed:
        return "one of " + ", ".join(str(choice) for choice in allowed)
    kind = base_type(info)
    if kind is int:
        return integer_words(declared_range(model, name))
    if kind in KIND_WORDS:
        return KIND_WORDS[kind]
    return "a list" if get_origin(kind) in (tuple, list) else "a mapping"


def type_name(info: FieldInfo) -> str:
    """The declared type in a table's words: `integer`, `number`, `true/false`, the choices, "... or none"."""
    allowed = choices(info)
    kind = base_type(info)
    name = (" \\| ".join(f"`{c}`" for c in allowed) if allowed else
            {int: "integer", float: "number", bool: "true/false", str: "name"}.get(kind)
            or ("list" if get_origin(kind) in (tuple, list) else "mapping"))
    return f"{name} or none" if is_optional(info) else name

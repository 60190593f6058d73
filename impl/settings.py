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
    def name_of(cls, field_name: str) -> str:
        """What a refusal calls the setting `field_name`: its own name here, the flag that gives it for a verb's
        flags (dflash_audit/verb_flags.py)."""
        return field_name

    @classmethod
    def refused(cls, name: str | None, message: str) -> Exception:
        """The error a refusal raises: `name` is the setting's (`name_of`), None for a rule between settings, whose
        message is whole."""
        return SpecError(name or cls.SUBJECT, message)

    @classmethod
    def refusal(cls, exc: ValidationError, data: dict[str, Any]) -> Exception:
        """The one wording of pydantic's refusal of any declared settings (a drafter's spec, its recipe, a run's
        settings, a verb's flags): unknown fields first, then missing ones, then the first bad value in the order
        given, named as the user gave it (`name_of`)."""
        errors = exc.errors()
        for kind, words in (("extra_forbidden", "unknown"), ("missing", "missing")):
            names = sorted(cls.name_of(str(e["loc"][0])) for e in errors if e["type"] == kind)
            if names:
                return cls.refused(cls.SUBJECT, f"{words} fields {names}")
        first = first_error(exc, data)
        cause = (first.get("ctx") or {}).get("error")
        if isinstance(cause, SpecError):  # a validator's own refusal, already one line naming its field
            return cause
        if not first["loc"] or first["loc"][0] not in cls.model_fields:  # a rule between settings: its own words
            return cls.refused(None, str(cause) if cause is not None else first["msg"])
        name = str(first["loc"][0])
        return cls.refused(cls.name_of(name), problem(cls, name, first))


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
        return f"must be {choice_words(choices(info))}, got {value!r}"
    if kind == "too_short":
        return "is empty"
    if kind == "finite_number":
        return f"must be a finite number, got {value}"
    if len(error["loc"]) > 1 and kind in BOUND_ERRORS:  # an item of a list, out of the items' range
        return f"must be {range_words(declared_range(model, name))}, got {value}"
    if len(error["loc"]) > 1:  # an item of a list
        whole = base_type(info)
        whole = get_args(whole)[0] if get_origin(whole) is Annotated else whole
        item = get_args(whole)[0]
        item = get_args(item)[0] if get_origin(item) is Annotated else item
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
    """The values a Literal setting (or a list of them) takes (None aside); () for any other."""
    annotation = base_type(info)
    annotation = get_args(annotation)[0] if get_origin(annotation) is Annotated else annotation
    if get_origin(annotation) in (list, tuple) and get_args(annotation):
        annotation = get_args(annotation)[0]
    annotation = get_args(annotation)[0] if get_origin(annotation) is Annotated else annotation
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
        option = option.get("items", option)  # a list's items' range
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
    if len(found) == 1:  # one bound: said as it is ("at least 1", "at most 16")
        (kind, bound), = found.items()
        return {"gt": "greater than", "ge": "at least", "lt": "less than", "le": "at most"}[kind] + f" {bound:g}"
    def number(value: float) -> str:  # an integer bound as written (65536, never 6.5536e+04)
        return str(value) if isinstance(value, int) else f"{value:g}"

    low = f"({number(found['gt'])}" if "gt" in found else f"[{number(found['ge'])}" if "ge" in found else "(-inf"
    high = f"{number(found['lt'])})" if "lt" in found else f"{number(found['le'])}]" if "le" in found else "inf)"
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

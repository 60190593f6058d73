"""Every verb's flags as one pydantic model, declared once (`VerbFlags`): each flag a `Field` (its spellings, help,
default, bounds and choices), each rule between flags a model validator. The verb's typer options, its `--help`
and the flag tables of docs/usage.md (`python -m dflash_audit.verb_flags`) are generated from the model; typer
hands the values over, pydantic validates them all before anything is read, and the validated object is passed down
whole. A refusal is one line naming the flag the user typed (`--dpace-alpha: must be in (0, 1], got 2`), worded by
impl/settings.py's `Declared.refusal` for every declared setting of the tool, exit status 2.

A verb: its `VerbFlags` subclass in `dflash_audit/flags/<verb>.py` (the audit, tests and benchmarks build one to run
what the verb runs), and `register_verb(app, verb, VERBS[verb], Flags, run)` in `dflash_audit/commands/<verb>.py`,
where `run(flags)` does the work.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Annotated, Any, ClassVar, Literal, get_args, get_origin

import typer
from pydantic import AfterValidator, BeforeValidator, ConfigDict, Field
from pydantic.fields import FieldInfo

from foundation.errors import AuditError
from serving_engines.served import ALL_ENGINES
from impl.settings import Declared, base_type, choice_words, choices, is_optional, range_text


class VerbFlags(Declared):
    """A verb's flags, validated by pydantic as one model; a refusal names the flag (`name_of`)."""

    SUBJECT = "flags"
    # Lax: typer has already read each flag's text as its kind (a path, an integer); a NaN or an infinite number
    # given to a flag is a typo.
    model_config = ConfigDict(frozen=True, extra="forbid", strict=False, allow_inf_nan=False,
                              arbitrary_types_allowed=True)
    VERB: ClassVar[str] = ""

    @classmethod
    def name_of(cls, field_name: str) -> str:
        return flag_of(cls.model_fields[field_name], field_name) if field_name in cls.model_fields else field_name

    @classmethod
    def refused(cls, name: str | None, message: str) -> Exception:
        return AuditError(message if name is None else f"{name}: {message}")


def flag(default: Any, *spellings: str, help: str, hidden: bool = False, cli: Any = None, arguments: bool = False,
         argument: bool = False, **bounds: Any) -> Any:
    """A flag's declaration: its default, its spellings (default `--field-name`), its help and its bounds. `cli`:
    the kind typer reads when it is not the field's own (a comma list parsed by the model's validator);
    `argument`: a positional argument, named by its one spelling (`DIR`); `arguments`: the words after `--` (trace's
    command)."""
    extra = {"flags": list(spellings), "hidden": hidden, "arguments": arguments, "argument": argument}
    if cli is not None:  # its default is text too (`"auto"`, `"vllm,sglang"`): read as a given value is
        extra["cli"] = cli
        bounds.setdefault("validate_default", True)
    return Field(default, description=help, json_schema_extra=extra, **bounds)


def flag_of(info: FieldInfo, name: str) -> str:
    """The flag a field is given by (its first spelling)."""
    spellings = (info.json_schema_extra or {}).get("flags") or [f"--{name.replace('_', '-')}"]
    return spellings[0].split("/")[0]


def _unannotated(kind: Any) -> Any:
    return get_args(kind)[0] if get_origin(kind) is Annotated else kind


def cli_kind(info: FieldInfo) -> Any:
    """The kind typer reads a flag's text as: the field's, with a choice read as text (pydantic judges it)."""
    extra = info.json_schema_extra or {}
    if "cli" in extra:
        return extra["cli"]
    kind = _unannotated(base_type(info))
    if get_origin(kind) in (list, tuple):
        item = _unannotated(get_args(kind)[0])
        return list[str] if get_origin(item) is Literal else list[item]
    kind = str if get_origin(kind) is Literal else kind
    return kind | None if is_optional(info) else kind


def flag_help(model: type[VerbFlags], name: str) -> str:
    """A flag's help: its description, its choices and its range, from its declaration."""
    info = model.model_fields[name]
    words = info.description or ""
    allowed = choices(info)
    if allowed and not all(str(choice) in words for choice in allowed):
        words += f" ({choice_words(allowed)})"
    bounds = range_text(model, name)
    if bounds:
        words += f" ({bounds})"
    return words


def parameters(model: type[VerbFlags]) -> list[inspect.Parameter]:
    """One typer option per field of `model`, as typer reads a command's keyword parameters."""
    out = []
    for name, info in model.model_fields.items():
        extra = info.json_schema_extra or {}
        if extra.get("arguments"):  # the words after `--` (trace's command), not an option
            continue
        default = ... if info.is_required() else info.get_default(call_default_factory=True)
        if "cli" in extra and default is not None and not isinstance(default, str):
            default = None  # read from text the model parses (`--chat-template-kwargs`): not given is None
        spellings = extra.get("flags") or [f"--{name.replace('_', '-')}"]
        if extra.get("argument"):  # a positional argument (data-check's DIR)
            option = typer.Argument(default, metavar=spellings[0], help=flag_help(model, name))
        else:
            option = typer.Option(default, *spellings, help=flag_help(model, name), hidden=extra.get("hidden", False),
                                  show_default=default not in (None, [], ...))
        out.append(inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=option,
                                     annotation=cli_kind(info)))
    return out


def register_verb(app: typer.Typer, verb: str, summary: str, model: type[VerbFlags],
                  run: Callable[[Any], int | None], **command_options: Any) -> None:
    """`verb` (its one-line `summary`) as a typer command whose options are `model`'s fields: the values given,
    validated as one `model`, handed to `run`. A field declared `arguments` receives the words after `--`."""
    arguments = [n for n, i in model.model_fields.items() if (i.json_schema_extra or {}).get("arguments")]

    def command(ctx: typer.Context, **given: Any) -> int:
        if arguments:
            given[arguments[0]] = list(ctx.args)
        elif ctx.args:
            raise AuditError(f"unexpected arguments {ctx.args}")
        return run(model(**given)) or 0

    context = inspect.Parameter("ctx", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=typer.Context)
    command.__signature__ = inspect.Signature([context, *parameters(model)])
    command.__name__ = verb.replace("-", "_")
    if arguments:
        command_options.setdefault("context_settings", {"allow_extra_args": True, "ignore_unknown_options": True})
    app.command(verb, help=summary, **command_options)(command)


# -- flags several verbs take, declared once ---------------------------------------------------------------------
DEVICE_HELP = "auto (CUDA when available) | cpu | cuda | cuda:N; under torchrun each rank takes GPU LOCAL_RANK"
DTYPE_HELP = "auto (the target's config.json dtype) | bfloat16 | float16 | float32; the drafters run in it too"
DEVICE_MAP_HELP = "auto: shard a target too large for one GPU over the GPUs, then the CPU (accelerate)"
CHAT_TEMPLATE_HELP = "auto | none | FILE (a Jinja chat template); on/off: the older names of auto-required/none"
DTYPE_NAMES = ("auto", "bfloat16", "float16", "float32")


def comma_list(value: Any) -> Any:
    """A comma-separated flag (`--dtype bfloat16,float32`, `--engine vllm,sglang`) as its items."""
    return [part.strip() for part in value.split(",") if part.strip()] if isinstance(value, str) else value


def once_each(values: list) -> list:
    repeated = sorted({str(v) for v in values if values.count(v) > 1})
    if repeated:
        raise ValueError(f"names {', '.join(repeated)} twice")
    return values


def device_name(value: str) -> str:
    if value in ("auto", "cpu", "cuda") or (value.startswith("cuda:") and value[5:].isdigit()):
        return value
    raise ValueError(f"must be auto, cpu, cuda or cuda:N, got {value!r}")


def chat_kwargs(value: Any) -> Any:
    """`--chat-template-kwargs` JSON as the object it is (the tool's own keys refused)."""
    from foundation.chat_template import kwargs_from_json

    return kwargs_from_json(value) if isinstance(value, str) or value is None else value


def first_of_each(values: list) -> list:
    return list(dict.fromkeys(values))  # `vllm,vllm` is vllm once, `--seeds 1,1` seed 1


Device = Annotated[str, AfterValidator(device_name)]
Dtypes = Annotated[list[Literal[DTYPE_NAMES]], BeforeValidator(comma_list), AfterValidator(once_each),
                   Field(min_length=1)]
ChatKwargs = Annotated[dict[str, Any], BeforeValidator(chat_kwargs)]
Engines = Annotated[list[Literal[ALL_ENGINES]], BeforeValidator(comma_list), AfterValidator(first_of_each),
                    Field(min_length=1)]


def max_new_tokens_flag(default: int, help: str = "Tokens generated per prompt.") -> Any:
    return flag(default, help=help + " The bound is beyond any target's context window.", ge=1, le=1 << 20)


def budget_flag(default: Any = 32) -> Any:
    return flag(default, help="DDTree node budget (the whole tree is verified in one target pass).", ge=1,
                le=1 << 16)


def tau_bin_flag() -> Any:
    """`--tau-bin-tokens`: the width of τ along the context's bins, on every τ report."""
    from impl.acceptance import POSITION_BIN_TOKENS

    return flag(POSITION_BIN_TOKENS, help="τ along the context: width in tokens of its position and prompt-length bins "
                                         "(a round counts the tokens it adds, the bonus token included, at its "
                                         "anchor's position, as speculators' acceptance_report.py)", ge=1, le=1 << 20)


def force_flag(what: str = "report files at --out / --json") -> Any:
    return flag(False, help=f"replace {what} that the tool did not write")

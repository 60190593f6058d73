"""The `train` options of the recipe knobs, generated from their declarations (impl/recipe.py): each flag, its older
spellings, its type, and its help with the default `train` uses. Adding a knob there adds its option here.

Every option defaults to None ("not given"): `--recipe speculators` fills what is not given, and the recipe's own
checks (`impl.recipe.knob_problem`) judge the values when the run starts.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import typer

from impl.recipe import KNOBS, TRAIN_DEFAULTS, bounds_text, choices


def knob_help(name: str) -> str:
    info = KNOBS[name]
    allowed = choices(name)
    limits = f"; must be {bounds_text(name)}" if bounds_text(name) else ""
    one_of = f"; one of {', '.join(allowed)}" if allowed else ""
    # Round brackets: typer's rich help reads "[...]" as markup and drops it.
    return f"{info.description}{one_of}{limits} (default: {TRAIN_DEFAULTS[name]})."


def knob_parameters() -> list[inspect.Parameter]:
    """One keyword parameter per recipe knob, as typer reads a command's options."""
    parameters = []
    for name, info in KNOBS.items():
        kind = str if choices(name) else {float: float, int: int, bool: bool, str: str}.get(info.annotation, int)
        option = typer.Option(None, *info.json_schema_extra["flags"], help=knob_help(name))
        parameters.append(inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=option,
                                            annotation=kind | None))
    return parameters


def with_knob_options(command: Callable) -> Callable:
    """`command(..., **knobs)` with an option per recipe knob in place of `**knobs` (once: a verb may be
    registered again)."""
    if hasattr(command, "__signature__"):
        return command
    signature = inspect.signature(command, eval_str=True)
    fixed = [p for p in signature.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    command.__signature__ = signature.replace(parameters=fixed + knob_parameters())
    return command

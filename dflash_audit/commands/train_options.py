"""The `train` options of the recipe knobs and of the drafter settings `train` takes, generated from their
declarations (impl/recipe.py, impl/spec.py): each flag, its older spellings, its type, and its help with the
default `train` uses. Adding a knob or a trainable setting there adds its option here.

Every option defaults to None ("not given"): `--recipe speculators` fills what is not given, and each setting's
declaration (pydantic's, impl/settings.py) judges the values when the run starts.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import typer

from impl import spec
from impl.recipe import KNOBS, TRAIN_DEFAULTS, Recipe, choices
from impl.run_settings import RunSettings
from impl.settings import base_type, range_text


def run_option(name: str) -> Any:
    """The option of a run setting (impl/train.py `RunSettings`): its declared default and description as help."""
    info = RunSettings.model_fields[name]
    return typer.Option(info.default, help=info.description)


def knob_help(name: str) -> str:
    info = KNOBS[name]
    allowed = choices(name)
    limits = f"; must be {range_text(Recipe, name)}" if range_text(Recipe, name) else ""
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


def setting_help(name: str) -> str:
    """A drafter setting's help: its description and what `train` uses without it."""
    given = spec.TRAIN_DEFAULTS[name]
    default = given if given is not None else spec.extra(name)["train_default_of"]
    return f"{spec.SETTINGS[name].description} (default: {default})."


def setting_parameters() -> list[inspect.Parameter]:
    """One keyword parameter per drafter setting `train` takes, named as its run field (`draft_layers`); a list
    setting is given comma-separated (`--target-layer-ids 1,16,31`)."""
    parameters = []
    for name in spec.TRAIN_SETTINGS:
        kind = base_type(spec.SETTINGS[name])
        option = typer.Option(None, *spec.extra(name)["flags"], help=setting_help(name))
        parameters.append(inspect.Parameter(spec.RUN_FIELDS[name], inspect.Parameter.KEYWORD_ONLY, default=option,
                                            annotation=(kind if kind in (int, bool) else str) | None))
    return parameters


def with_knob_options(command: Callable) -> Callable:
    """`command(..., **knobs)` with an option per recipe knob and per trainable drafter setting in place of
    `**knobs` (once: a verb may be registered again)."""
    if hasattr(command, "__signature__"):
        return command
    signature = inspect.signature(command, eval_str=True)
    fixed = [p for p in signature.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    command.__signature__ = signature.replace(parameters=fixed + setting_parameters() + knob_parameters())
    return command

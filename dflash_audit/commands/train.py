"""`dflash-audit train`: our online DFlash trainer (also under `torchrun --nproc_per_node=N`); what it runs is
`dflash_audit/training.py`.

The options of the recipe knobs and of the drafter settings `train` takes are generated from their declarations
(impl/recipe.py, impl/spec.py): each flag, its older spellings, its type, and its help with the default `train` uses.
Adding a knob or a trainable setting there adds its option here. Every such option defaults to None ("not given"):
`--recipe speculators` fills what is not given. The other options' defaults and help are `TrainSettings`'
(dflash_audit/training.py), and pydantic validates every value there, before the target is read.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Any

import typer

from dflash_audit.commands import VERBS
from impl import spec
from impl.recipe import KNOBS, TRAIN_DEFAULTS, Recipe, choices
from dflash_audit.training import TrainSettings, run_train
from impl.settings import base_type, range_text


def run_option(name: str) -> Any:
    """The option of a train setting (`TrainSettings`): its declared default and description as help."""
    info = TrainSettings.model_fields[name]
    return typer.Option(info.default, help=info.description)


def run_recipe_option(name: str, *flags: str) -> Any:
    """An option `--recipe speculators` also sets: None when not given (then the recipe's value, or the default)."""
    info = TrainSettings.model_fields[name]
    default = info.default if info.default is not None else "steps // 100 with --recipe speculators"
    return typer.Option(None, *flags, help=f"{info.description} (default: {default}).")


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


def train(
    target: Path = typer.Option(..., help="Hugging Face target directory (model + tokenizer)."),
    data: Path = typer.Option(..., help="JSON lines: {'text'}, {'input_ids'[, 'loss_mask']} or {'messages'}."),
    out: Path = typer.Option(..., help="Checkpoint to write (ckpt.pt)."),
    steps: int = run_option("steps"),
    lr: float = run_recipe_option("lr"),
    warmup: int = run_recipe_option("warmup"),
    optimizer: str = run_recipe_option("optimizer"),
    lr_schedule: str = run_recipe_option("lr_schedule"),
    batch_size: int = run_option("batch_size"),
    grad_accum: int = run_option("grad_accum"),
    seq_len: int = run_option("seq_len"),
    recipe: str = run_option("recipe"),
    d2t: Path = typer.Option(None, "--d2t", help="The draft-to-target map to use instead: a .npy of offsets "
                                                 "(target id = draft id + d2t[draft id]), as speculators writes."),
    dtype: str = run_option("dtype"),
    eval_data: Path = typer.Option(None, help="Held-out JSON lines (default: the last --eval-sequences rows)."),
    eval_sequences: int = run_option("eval_sequences"),
    eval_every: int = run_option("eval_every"),
    save_every: int = run_option("save_every"),
    resume: bool = run_option("resume"),
    force: bool = typer.Option(False, "--force", help="Replace an existing file at --out / --json instead of "
                                                      "refusing it."),
    seed: int = run_option("seed"),
    max_seconds: float = run_option("max_seconds"),
    json_out: Path = typer.Option(None, "--json", help="Write the run's stats as JSON."),
    family: str = run_option("family"),
    **knobs,  # one option per trainable drafter setting (impl/spec.py) and per recipe knob (impl/recipe.py),
    # generated from their declarations (with_knob_options)
) -> None:
    stats = run_train(target, data, out, d2t=d2t, eval_data=eval_data, json_out=json_out, force=force, steps=steps,
                      lr=lr, warmup=warmup, optimizer=optimizer, lr_schedule=lr_schedule, batch_size=batch_size,
                      grad_accum=grad_accum, seq_len=seq_len,
                      recipe=recipe, dtype=dtype, eval_sequences=eval_sequences, eval_every=eval_every,
                      save_every=save_every, resume=resume, seed=seed, max_seconds=max_seconds, family=family,
                      **knobs)
    if stats["rank"] == 0:  # under torchrun only rank 0 reports
        final = stats["eval"] or stats["final"]
        typer.echo(f"trained {stats['steps']} steps in {stats['seconds']} s -> {stats['out']}  "
                   f"loss {final['loss']:.4f}  EAL {final['eal']:.2f}")


def register(app: typer.Typer) -> None:
    app.command("train", help=VERBS["train"])(with_knob_options(train))

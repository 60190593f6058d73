"""What `dflash-audit train` runs: its paths and flags checked before the tokenizer, the data or the target are read,
the run settings made (`impl/run_settings.py`, validated by pydantic), our trainer run (`impl/train.py`, also under
`torchrun --nproc_per_node=N`) and its stats written as JSON."""

from __future__ import annotations

import json
from pathlib import Path

from dflash_audit.formats.setting_names import DeclarationError, convert
from dflash_audit.outputs import check_not_foreign, check_outputs, check_writable
from foundation.errors import AuditError
from foundation.inputs import check_finite_flags, check_target_dir, regular_file
from impl import spec
from impl.families import TITLES, TRAINED_FAMILIES
from impl.recipe import KNOBS
from impl.run_settings import RunSettings, TrainError
from impl.spec import FAMILY_FIELDS


def drafter_settings(options: dict) -> dict:
    """The trainable drafter settings given on the command line (popped from `options`), by run field, each
    checked against its declaration: `--target-layer-ids 1,16,31` read as every other source reads the setting,
    `--layer-types` split at commas."""
    given = {}
    for name in spec.TRAIN_SETTINGS:
        field_name, flag = spec.RUN_FIELDS[name], spec.extra(name)["flags"][0].split("/")[0]
        value = options.pop(field_name, None)
        if value is None:
            continue
        if name == "target_layer_ids":
            try:
                value = convert(name, value, flag)
            except DeclarationError as exc:
                raise AuditError(str(exc)) from None
        elif name == "layer_types":
            value = [t.strip() for t in value.split(",")] if value else None
        problem = spec.setting_problem(name, value)
        if problem:
            raise AuditError(f"{flag} {problem}")
        given[field_name] = value
    return given


def check_out(out: Path, resume: bool, force: bool = False) -> None:
    """--out is a checkpoint file: never a directory, never someone else's file; an existing one is
    only this run's own to --resume, or replaced with --force."""
    from dflash_audit.formats import ours

    if out.is_dir():
        raise AuditError(f"--out {out}: a directory; --out is the checkpoint file to write (e.g. {out / 'ckpt.pt'})")
    if out.exists() and out.is_file() and out.suffix != ".pt":
        raise AuditError(f"--out {out}: an existing file that is not a *.pt checkpoint; refusing to overwrite it")
    if resume and out.exists() and not out.is_file():
        raise AuditError(f"--out {out}: not a checkpoint file to --resume from")
    if not out.is_file() or force:
        return
    if not ours.detect(out):
        raise AuditError(f"--out {out}: an existing file that is not a checkpoint dflash-audit wrote; refusing "
                         "to overwrite it (choose another path, or pass --force to replace it)")
    if not resume:
        raise AuditError(f"--out {out}: a checkpoint already exists there; pass --resume to continue that run, "
                         "or --force to replace it")


def check_train_paths(target: Path, data: Path, eval_data: Path | None, out: Path, json_out: Path | None,
                      resume: bool, force: bool = False) -> None:
    """Every path, before the tokenizer, the data or the target are read."""
    check_target_dir(target)
    regular_file(data, "file", "--data")
    if eval_data is not None:
        regular_file(eval_data, "file", "--eval-data")
    check_outputs({"--out": out, "--json": json_out}, {"--target": target, "--data": data, "--eval-data": eval_data})
    check_out(out, resume, force)
    check_writable("--out", out)
    if json_out is not None:
        check_writable("--json", json_out)
        check_not_foreign("--json", json_out, force)


def check_family_flags(family: str, given: dict) -> None:
    """--family names one of the families; a family's own flag (its drafter's shape, its loss knobs) needs it."""
    if family not in TRAINED_FAMILIES:
        raise AuditError(f"--family must be one of {', '.join(TRAINED_FAMILIES)}, got {family!r}")
    for name, value in given.items():
        owner = flag_family(name)
        if value is not None and owner not in (None, family):
            raise AuditError(f"--{name.replace('_', '-')} is a {TITLES[owner]} setting; add --family {owner}")


def flag_family(name: str) -> str | None:
    """The family a train setting belongs to: a drafter field of one family, or a recipe knob declared for one."""
    if name in KNOBS:
        return KNOBS[name].json_schema_extra["family"]
    return next((family for family, names in FAMILY_FIELDS.items() if name in names), None)


def recipe_settings(recipe: str | None, family: str, given: dict) -> dict:
    """The TrainConfig knobs: `--recipe speculators`'s whole resolution, then every flag given explicitly."""
    if recipe not in (None, "speculators"):
        raise AuditError(f"--recipe must be speculators, got {recipe!r}")
    settings = {}
    if recipe == "speculators":
        from reference_adapters.speculators_recipe import train_settings

        settings = train_settings(family)
    settings.update({name: value for name, value in given.items() if value is not None})
    return settings


def run_train(target: Path, data: Path, out: Path, *, steps: int, lr: float, warmup: int, batch_size: int,
              grad_accum: int, seq_len: int, recipe: str | None, d2t: Path | None, dtype: str, eval_data: Path | None,
              eval_sequences: int, eval_every: int, save_every: int, resume: bool, force: bool, seed: int,
              max_seconds: float | None, json_out: Path | None, family: str, knobs: dict) -> dict:
    """Train as the flags ask; the run's stats (`rank` 0 has written them to `json_out`). `knobs`: the trainable
    drafter settings and recipe knobs given, by run field (None: not given)."""
    from transformers.utils import logging as hf_logging

    from impl.data import DataError
    from impl.train import train as run_training

    knobs = dict(knobs)
    check_train_paths(target, data, eval_data, out, json_out, resume, force)
    if d2t is not None:
        regular_file(d2t, "file", "--d2t")
    drafter = drafter_settings(knobs)  # the trainable spec settings given, by run field; the rest are recipe knobs
    check_finite_flags(lr=lr, max_seconds=max_seconds,
                       **{name: value for name, value in knobs.items() if KNOBS[name].annotation is float})
    check_family_flags(family, {**drafter, **knobs})
    if dtype not in ("fp32", "bf16"):
        raise AuditError(f"--dtype must be fp32 or bf16, got {dtype!r}")
    # The run settings are validated when made; the recipe knobs by the recipe type when the run starts.
    settings = recipe_settings(recipe, family, {**drafter, **knobs})
    hf_logging.disable_progress_bar()  # one progress bar: the trainer's
    try:
        cfg = RunSettings(
            target=str(target), out=str(out), data=str(data), eval_data=str(eval_data) if eval_data else None,
            eval_sequences=eval_sequences, steps=steps, lr=lr, warmup=warmup, batch_size=batch_size,
            grad_accum=grad_accum, seq_len=seq_len, d2t=str(d2t) if d2t is not None else None, dtype=dtype,
            eval_every=eval_every, save_every=save_every, resume=resume, seed=seed, max_seconds=max_seconds,
            family=family, **settings)
        stats = run_training(cfg)
    except (DataError, TrainError) as exc:
        raise AuditError(str(exc)) from exc
    if stats["rank"] == 0 and json_out is not None:  # under torchrun only rank 0 reports
        from foundation.atomic import atomic_write_bytes

        text = json.dumps({"schema": "dflash-audit/train/1", **stats}, indent=2)
        atomic_write_bytes(json_out, lambda tmp: Path(tmp).write_text(text))
    return stats

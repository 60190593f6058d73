"""What `dflash-audit train` runs: its paths checked before the tokenizer, the data or the target are read, its
flags validated by pydantic as one model (`TrainSettings`: the run settings of `impl/run_settings.py` as the flags
give them, each refusal one line naming its flag), our trainer run (`impl/train.py`, also under
`torchrun --nproc_per_node=N`) and its stats written as JSON. Light on purpose: `commands/train.py` reads its
options' defaults and help from these declarations at start-up, so torch is imported only to train."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator

from dflash_audit.outputs import check_not_foreign, check_outputs, check_writable
from foundation.errors import AuditError
from impl import spec
from impl.families import TITLES, TRAINED_FAMILIES
from impl.recipe import KNOBS
from impl.run_settings import RunSettings, TrainError
from impl.spec import FAMILY_FIELDS

# Each drafter setting and recipe knob `train` takes, by run field: its flag (the first spelling). None given is
# "not given": the family's `train` default, or `--recipe speculators`'s value.
FLAGS = {**{spec.RUN_FIELDS[name]: spec.extra(name)["flags"][0] for name in spec.TRAIN_SETTINGS},
         **{name: info.json_schema_extra["flags"][0] for name, info in KNOBS.items()}}
# The run's settings `--recipe speculators` also sets (its optimizers and schedule): like the knobs, not given is None.
RUN_RECIPE_FIELDS = ("optimizer", "lr_schedule", "lr", "weight_decay", "adam_betas", "muon_lr", "muon_momentum",
                     "muon_weight_decay", "muon_adjust_lr_fn", "warmup", "grad_clip")
# The family a family's own setting belongs to, by run field: a drafter field of one family, or a knob declared for one.
OWNERS = {**{spec.RUN_FIELDS.get(name, name): family for family, names in FAMILY_FIELDS.items() for name in names},
          **{name: info.json_schema_extra["family"] for name, info in KNOBS.items() if info.json_schema_extra["family"]}}


def flag_of(field_name: str) -> str:
    """The flag that gives a `TrainSettings` field (`--target-layer-ids`, `--confidence-head`, `--batch-size`)."""
    return FLAGS.get(field_name, "--" + field_name.replace("_", "-")).split("/")[0]


class TrainSettings(RunSettings):
    """`train`'s flags as one run's settings, each validated by pydantic against its declaration in
    `RunSettings` (kind, choices, bounds, finite), and `--recipe`; a refusal is one line naming the flag. The rule
    between flags (a family's own setting needs that family) is the model's own."""

    SUBJECT = "train settings"

    recipe: Literal["speculators"] | None = Field(
        None, description="'speculators': the whole recipe speculators' TrainConfig resolves for --speculator-type "
        "dflash (loss_fn, per_position_loss_weight, dpace_alpha, gamma, max_anchors, block_size, draft layers) and "
        "its run (Muon on the 2-D weights + AdamW, lr 1e-3, linear schedule warming up over 1% of the steps, clip "
        "1.0), read from the installed package; flags given explicitly still win.")

    @model_validator(mode="before")
    @classmethod
    def from_flags(cls, data: dict[str, Any]) -> dict[str, Any]:
        """The flags as given: the ones not given dropped, the list settings read from their comma-separated text
        (`--target-layer-ids 1,16,31` as every other source reads it), a family's own flag refused without that
        family, then `--recipe speculators`'s resolution under the flags given."""
        data = {name: value for name, value in data.items()
                if value is not None or (name not in FLAGS and name not in RUN_RECIPE_FIELDS)}
        if isinstance(data.get("target_layer_ids"), str):
            from dflash_audit.formats.setting_names import convert  # its ValueError names the flag

            data["target_layer_ids"] = tuple(convert("target_layer_ids", data["target_layer_ids"],
                                                     flag_of("target_layer_ids")))
        if isinstance(data.get("layer_types"), str):
            types = tuple(t.strip() for t in data.pop("layer_types").split(","))
            if any(types):  # `--layer-types ""` is not given
                data["layer_types"] = types
        family = data.get("family", cls.model_fields["family"].default)
        if family not in TRAINED_FAMILIES:
            return data  # the family's own refusal
        for name in data:
            owner = OWNERS.get(name)
            if owner not in (None, family):
                raise ValueError(f"{flag_of(name)} is a {TITLES[owner]} setting; add --family {owner}")
        if data.get("recipe") == "speculators":
            from reference_adapters.speculators_recipe import train_settings
            from reference_adapters.speculators_run_recipe import train_run_settings

            data = {**train_settings(family), **train_run_settings(family), **data}
        return data

    @classmethod
    def name_of(cls, field_name: str) -> str:
        return flag_of(field_name)

    @classmethod
    def refused(cls, name: str | None, message: str) -> Exception:
        return AuditError(message if name is None else f"{name}: {message}")


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
    from foundation.inputs import check_target_dir, regular_file

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


def run_train(target: Path, data: Path, out: Path, *, d2t: Path | None, eval_data: Path | None,
              json_out: Path | None, force: bool, **flags: Any) -> dict:
    """Train as the flags ask; the run's stats (`rank` 0 has written them to `json_out`). `flags`: every other
    `TrainSettings` field by name, the drafter settings and recipe knobs None when not given."""
    from transformers.utils import logging as hf_logging

    from foundation.inputs import regular_file
    from impl.data import DataError
    from impl.train import train as run_training

    # Every flag judged by its declaration first, then the paths, before the tokenizer, data or target are read.
    settings = TrainSettings(target=str(target), out=str(out), data=str(data),
                             eval_data=str(eval_data) if eval_data else None,
                             d2t=str(d2t) if d2t is not None else None, **flags)
    check_train_paths(target, data, eval_data, out, json_out, settings.resume, force)
    if d2t is not None:
        regular_file(d2t, "file", "--d2t")
    hf_logging.disable_progress_bar()  # one progress bar: the trainer's
    try:
        stats = run_training(settings)
    except (DataError, TrainError) as exc:
        raise AuditError(str(exc)) from exc
    if stats["rank"] == 0 and json_out is not None:  # under torchrun only rank 0 reports
        from foundation.atomic import atomic_write_bytes

        text = json.dumps({"schema": "dflash-audit/train/1", **stats}, indent=2)
        atomic_write_bytes(json_out, lambda tmp: Path(tmp).write_text(text))
    return stats

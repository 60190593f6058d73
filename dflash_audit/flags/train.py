"""`train`'s flags, declared once (`TrainFlags`): its paths, and every run setting `train` takes as the flag that gives
it. Each run setting is declared once, in `RunSettings` (impl/run_settings.py: the run's own, every trainable drafter
setting of impl/spec.py, every recipe knob of impl/recipe.py); its flag here is that declaration (kind, choices,
bounds, description) under its spellings, so adding a knob or a trainable setting there adds its flag, its `--help`
and its docs row. A drafter setting, a recipe knob or a setting `--recipe speculators` also sets is None when not
given: the family's `train` default, or the recipe's value. The rules between flags (a family's own setting needs
its family, `--recipe speculators` fills what is not given) are the model's own. Light: no torch."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal, Optional

from pydantic import create_model, model_validator
from pydantic.fields import FieldInfo

from dflash_audit.flags import VerbFlags, flag, force_flag
from foundation.errors import AuditError
from impl import spec
from impl.families import TITLES, TRAINED_FAMILIES
from impl.recipe import KNOBS, TRAIN_DEFAULTS
from impl.run_settings import RunSettings
from impl.spec import FAMILY_FIELDS, LAYER_TYPES, SpecError

# The run's own settings `train` takes, in `--help`'s order.
RUN_FLAGS = ("steps", "lr", "warmup", "optimizer", "lr_schedule", "batch_size", "grad_accum", "seq_len", "dtype",
             "eval_sequences", "eval_every", "save_every", "resume", "seed", "max_seconds", "family")
# The run settings `--recipe speculators` also sets (its optimizers and schedule): like a knob, not given is None.
RUN_RECIPE_FIELDS = ("optimizer", "lr_schedule", "lr", "weight_decay", "adam_betas", "muon_lr", "muon_momentum",
                     "muon_weight_decay", "muon_adjust_lr_fn", "warmup", "grad_clip")
# Each drafter setting `train` takes (by run field) and each recipe knob: its spellings, declared with it.
SPELLINGS = {**{spec.RUN_FIELDS[name]: spec.extra(name)["flags"] for name in spec.TRAIN_SETTINGS},
             **{name: info.json_schema_extra["flags"] for name, info in KNOBS.items()}}
# The settings given as comma-separated text (`--target-layer-ids 1,16,31`), read by the model's validator; a layer
# type is one of the declared ones as soon as it is typed (a drafter's spec lists unknown ones when it is checked).
LIST_FLAGS = {"target_layer_ids": tuple[int, ...], "layer_types": tuple[Literal[LAYER_TYPES], ...]}
# The family a family's own setting belongs to, by run field: a drafter field of one family, or a knob declared for one.
OWNERS = {**{spec.RUN_FIELDS.get(name, name): family for family, names in FAMILY_FIELDS.items() for name in names},
          **{name: info.json_schema_extra["family"] for name, info in KNOBS.items() if info.json_schema_extra["family"]}}


def default_words(name: str) -> str:
    """What `train` uses when the flag `name` is not given."""
    if name in KNOBS:
        return str(TRAIN_DEFAULTS[name]) if TRAIN_DEFAULTS[name] is not None else ""
    settings = {run: setting for setting, run in spec.RUN_FIELDS.items() if setting in spec.TRAIN_SETTINGS}
    if name in settings:
        given = spec.TRAIN_DEFAULTS[settings[name]]
        return str(given if given is not None else spec.extra(settings[name])["train_default_of"])
    default = RunSettings.model_fields[name].default
    return str(default) if default is not None else "steps // 100 with --recipe speculators"


def run_flag(name: str) -> tuple[Any, FieldInfo]:
    """The run setting `name` as `train`'s flag: its declaration in `RunSettings`, under its spellings; None when not
    given where the family or `--recipe speculators` supplies it."""
    declared = RunSettings.model_fields[name]
    not_given = name in SPELLINGS or name in RUN_RECIPE_FIELDS
    description = declared.description or ""
    if not_given and default_words(name):
        description = f"{description.rstrip('.')} (default: {default_words(name)})."
    field = FieldInfo.merge_field_infos(declared, default=None if not_given else declared.default,
                                        description=description, json_schema_extra=None)
    extra: dict[str, Any] = {"flags": list(SPELLINGS.get(name, [f"--{name.replace('_', '-')}"]))}
    if name in LIST_FLAGS:
        extra["cli"] = str | None
    field.json_schema_extra = extra
    annotation = LIST_FLAGS.get(name, declared.annotation)
    return (Optional[annotation] if not_given else annotation), field


def flag_refusal(exc: SpecError) -> SpecError | AuditError:
    """A rule between run settings, judged once the recipe is resolved or the target read (`seq_len 4 leaves no room
    for a block of 16`), worded as every refusal is: naming the flag that gives the setting."""
    field = spec.RUN_FIELDS.get(exc.field, exc.field)
    if field not in TrainFlags.model_fields:
        return exc
    return AuditError(f"{TrainFlags.name_of(field)}: {str(exc).removeprefix(exc.field + ': ')}")


class TrainFlagsBase(VerbFlags):
    """`train`'s paths and `--recipe`; `TrainFlags` adds a flag per run setting."""

    VERB = "train"
    INTEGER_WORDS = True  # `--steps: must be a positive integer, got 0`

    target: Path = flag(..., help="Hugging Face target directory (model + tokenizer).")
    data: Path = flag(..., help="JSON lines: {'text'}, {'input_ids'[, 'loss_mask']} or {'messages'}.")
    out: Path = flag(..., help="Checkpoint to write (ckpt.pt).")
    recipe: Literal["speculators"] | None = flag(
        None, help="'speculators': the whole recipe speculators' TrainConfig resolves for --speculator-type dflash "
        "(loss_fn, per_position_loss_weight, dpace_alpha, gamma, max_anchors, block_size, draft layers) and its run "
        "(Muon on the 2-D weights + AdamW, lr 1e-3, linear schedule warming up over 1% of the steps, clip 1.0), read "
        "from the installed package; flags given explicitly still win.")
    d2t: Path | None = flag(None, "--d2t", help="The draft-to-target map to use instead: a .npy of offsets (target "
                                                "id = draft id + d2t[draft id]), as speculators writes.")
    eval_data: Path | None = flag(None, help="Held-out JSON lines (default: the last --eval-sequences rows).")
    json_out: Path | None = flag(None, "--json", help="Write the run's stats as JSON.")
    force: bool = force_flag("an existing file at --out / --json")

    @model_validator(mode="before")
    @classmethod
    def from_flags(cls, data: dict[str, Any]) -> dict[str, Any]:
        """The list settings read from their comma-separated text; a family's own flag refused without that
        family."""
        data = dict(data)
        if isinstance(data.get("target_layer_ids"), str):
            from dflash_audit.formats.setting_names import convert  # its ValueError names the flag

            data["target_layer_ids"] = tuple(convert("target_layer_ids", data["target_layer_ids"],
                                                     cls.name_of("target_layer_ids")))
        if isinstance(data.get("layer_types"), str):
            types = tuple(t.strip() for t in data["layer_types"].split(","))
            data["layer_types"] = types if any(types) else None  # `--layer-types ""` is not given
        given = {name: value for name, value in data.items() if value is not None}
        family = given.get("family", cls.model_fields["family"].default)
        if family not in TRAINED_FAMILIES:
            return data  # the family's own refusal
        for name in given:
            owner = OWNERS.get(name)
            if owner not in (None, family):
                raise ValueError(f"{cls.name_of(name)} is a {TITLES[owner]} setting; add --family {owner}")
        return data

    def run_settings(self) -> RunSettings:
        """The trainer's settings (impl/run_settings.py), as these flags give them: a setting not given is
        `--recipe speculators`'s value (read from the installed package), else the trainer's default."""
        given = {name: getattr(self, name) for name in RunSettings.model_fields
                 if name in type(self).model_fields and getattr(self, name) is not None}
        if self.recipe == "speculators":
            from reference_adapters.speculators_recipe import train_settings
            from reference_adapters.speculators_run_recipe import train_run_settings

            given = {**train_settings(self.family), **train_run_settings(self.family), **given}
        paths = {"target": str(self.target), "out": str(self.out), "data": str(self.data),
                 "eval_data": str(self.eval_data) if self.eval_data else None,
                 "d2t": str(self.d2t) if self.d2t is not None else None}
        return RunSettings(**{**given, **paths})


TrainFlags = create_model(
    "TrainFlags", __base__=TrainFlagsBase, __module__=__name__,
    __doc__="`train`'s flags: its paths, `--recipe`, and every run setting it takes, declared in `RunSettings`.",
    **{name: run_flag(name) for name in (*RUN_FLAGS, *SPELLINGS) if name not in TrainFlagsBase.model_fields},
)

"""How a drafter is trained (`Recipe`): every training knob declared once, as a pydantic field.

Each field carries its type, its default, its bounds and its description, and in `json_schema_extra`:
- `speculators`: the name speculators 0.9.0 gives it (None: speculators has no such setting);
- `zlab`: the name z-lab's dflash 0.1.0 gives it (None for every recipe knob: z-lab ships no trainer);
- `default_of`: whose default the field's default is (the one a checkpoint that does not say was trained with);
- `train_default` / `train_default_of`: what `dflash-audit train` uses when no flag is given, where it differs;
- `flags`: the `train` option and its older spellings; `names`: every key a checkpoint or config declares it under;
- `family`: the family a knob belongs to ("dflash2", "dspark", "xpress"), None for every DFlash drafter's;
- `family_defaults`: {family: [value, whose]} where speculators' trainer resolves that family to another value than
  dflash's `train_default` (`train_defaults(family)`; the conformance suite holds each to the installed speculators).

Everything else is derived from these declarations, never written again: the `train` options and their help
(`dflash_audit/commands/train.py`), `RunSettings`' recipe fields (`impl/run_settings.py`), the setting names the
format readers recognize (`dflash_audit/formats/setting_names.py`), every range check and its message
(pydantic's, worded by impl/settings.py), and the flag table of docs/training.md (`python -m impl.recipe`; tests/test_recipe_knobs.py keeps
the page equal to it).
"""

from __future__ import annotations

import json
import math
from typing import Annotated, Any, Literal, get_args

from pydantic import AfterValidator, Field

from impl import settings
from impl.layers import layer_range, layers_outside
from impl.settings import Declared
from impl.spec import SpecError

# speculators' loss_fn: one loss name, or a JSON dict of names to weights (`resolve_loss_config`): XPress trains with
# '{"ce": 0.1, "tv": 0.9}'. The names our trainer implements (impl/losses.py elementwise_loss):
LOSS_NAMES = ("kl_div", "ce", "tv")
# speculators' per_position_loss_weight: fixed exponential decay (gamma) or D-PACE (dpace_alpha).
LossWeighting = Literal["fixed-exp-decay", "dpace"]
MODEL_LEVEL = "speculators' model-level default (DFlashDraftModel.forward, compute_metrics)"
TRAINER = "speculators' TrainConfig for --speculator-type dflash"
XPRESS_LOSS = '{"ce": 0.1, "tv": 0.9}'
# A loss spec, in its one spelling (`canonical_loss_fn`; its ValueError is the refusal).
LossFn = Annotated[str, AfterValidator(lambda spec: canonical_loss_fn(spec))]


def trainer_of(family: str) -> str:
    return f"speculators' TrainConfig for --speculator-type {family}"


def knob(default: Any, description: str, *, speculators: str | None, default_of: str, names: tuple[str, ...],
         flags: tuple[str, ...], zlab: str | None = None, train_default: Any = None,
         train_default_of: str | None = None, family: str | None = None,
         family_defaults: dict[str, tuple[Any, str]] | None = None, **bounds: Any) -> Any:
    """A recipe field with everything the rest of the tool derives from it."""
    extra = {"speculators": speculators, "zlab": zlab, "default_of": default_of, "names": list(names),
             "flags": list(flags), "family": family,
             "family_defaults": {name: list(pair) for name, pair in (family_defaults or {}).items()}}
    if train_default_of is not None:
        extra.update(train_default=train_default, train_default_of=train_default_of)
    return Field(default, description=description, json_schema_extra=extra, **bounds)


class Recipe(Declared):
    """How a drafter was trained, in speculators' vocabulary. Defaults are speculators' model-level defaults
    (KL, fixed exponential decay): a checkpoint written before a field existed is read with that default, which is
    what it was trained with. `dflash-audit train` starts from `train_recipe()` instead (its trainer's defaults)."""

    SUBJECT = "recipe"

    gamma: float = knob(
        4.0, "fixed-exp-decay loss weights: w(k) = exp(-(k-1)/gamma), w(0) = 0", gt=0,
        speculators="dflash_decay_gamma", default_of="speculators (DFlashDraftModel.forward gamma, DFlashArgs)",
        names=("gamma", "loss_decay_gamma", "dflash_decay_gamma", "decay_gamma", "loss_gamma"), flags=("--gamma",))
    loss_fn: LossFn = knob(
        "kl_div", "kl_div (distil the verifier's logits), ce (its argmax), tv (1 - their overlap), or a JSON dict of "
        "them to weights, as speculators takes it", speculators="loss_fn",
        default_of=MODEL_LEVEL, train_default="ce", train_default_of=TRAINER,
        family_defaults={"dspark": ("kl_div", f"{trainer_of('dspark')} (_DEFAULT_LOSS_FN has no dspark entry)"),
                         "xpress": (XPRESS_LOSS, f"{trainer_of('xpress')} (_DEFAULT_LOSS_FN)")},
        names=("loss_fn", "loss_kind", "loss", "loss_type"), flags=("--loss-fn", "--loss"))
    # 0-based target decoder layer whose raw output gives the target logits; None means the final decoder layer.
    verifier_source_layer: int | None = knob(
        None, "decoder layer whose raw output gives the targets (default: the final one)", speculators=None,
        default_of="speculators (targets from verifier_last_hidden_states, the final layer)",
        names=("verifier_source_layer", "target_source_layer", "target_layer", "target_hidden_layer", "label_layer",
               "target_logits_layer"), flags=("--verifier-source-layer", "--target-source-layer"))
    noise_std: float = knob(
        0.0, "Gaussian noise on the drafter's context features only", ge=0, speculators=None,
        default_of="speculators (no hidden-state noise)", names=("noise_std", "hidden_noise_std"),
        flags=("--noise-std",))
    max_anchors: int = knob(
        512, "anchors (blocks) sampled per packed row", gt=0, speculators="max_anchors",
        default_of="speculators (DataArgs.max_anchors, DFlashDraftModel.forward)",
        names=("max_anchors", "num_anchors"), flags=("--max-anchors",))
    # The slot layout training applied; the drafter's own is `DraftSpec.sample_from_anchor`. Our trainer refuses a
    # recipe that disagrees with its drafter; the audit reports a checkpoint whose two disagree.
    sample_from_anchor: bool = knob(
        False, "slot layout: every slot proposes the next token, B per block (DSpark), or the anchor slot proposes "
        "nothing, B - 1 per block", speculators="sample_from_anchor",
        default_of="speculators (DFlashSpeculatorConfig.sample_from_anchor)", names=("sample_from_anchor",),
        family_defaults={"dspark": (True, f"{trainer_of('dspark')} (DSparkSpeculatorConfig.sample_from_anchor, "
                                          "_build_base_config_kwargs)")},
        flags=("--sample-from-anchor/--anchor-as-bonus",))
    per_position_loss_weight: LossWeighting = knob(
        "fixed-exp-decay", "per-position loss weights: dpace (D-PACE, needs ce) or fixed-exp-decay",
        speculators="per_position_loss_weight", default_of=MODEL_LEVEL, train_default="dpace",
        train_default_of=TRAINER,
        family_defaults={family: ("fixed-exp-decay", f"{trainer_of(family)} (D-PACE is dflash's only)")
                         for family in ("dspark", "xpress")}, names=("per_position_loss_weight", "loss_weighting", "position_loss_weight"),
        flags=("--per-position-loss-weight", "--loss-weighting"))
    dpace_alpha: float = knob(
        0.5, "D-PACE confidence smoothing, used when per_position_loss_weight is dpace", gt=0, le=1,
        speculators="dpace_alpha", default_of="speculators (DFlashArgs.dpace_alpha, DFlashDraftModel.forward)",
        names=("dpace_alpha",), flags=("--dpace-alpha",))
    selector_loss_alpha: float = knob(
        1.0, "DFlash2: weight of the selector's K-way CE beside the unary loss", ge=0,
        speculators="selector_loss_alpha", default_of="speculators (DFlash2Args.selector_loss_alpha)",
        names=("selector_loss_alpha",), flags=("--selector-loss-alpha",), family="dflash2")
    # DSpark (speculators' models/dspark): the confidence head's BCE toward 1 - TV(draft, target).
    confidence_head_alpha: float = knob(
        1.0, "DSpark: weight of the confidence head's BCE toward each slot's acceptance rate 1 - TV", ge=0,
        speculators="confidence_head_alpha",
        default_of="speculators (DSparkArgs.confidence_head_alpha, DSparkDraftModel.forward)",
        names=("confidence_head_alpha",), flags=("--confidence-head-alpha",), family="dspark")
    # XPress (speculators' models/xpress): free-running Jacobi rounds and the backbone's own logits beside the
    # teacher-forced refined logits.
    consistency_weight: float = knob(
        0.3, "XPress: weight of the mean loss of the free-running Jacobi rounds (0: none)", ge=0,
        speculators="consistency_weight",
        default_of="speculators (XPressArgs.consistency_weight, XPressDraftModel.forward)",
        names=("consistency_weight",), flags=("--consistency-weight",), family="xpress")
    consistency_passes: int = knob(
        3, "XPress: free-running rounds, each fed the previous round's argmax (0: none)", ge=0,
        speculators="consistency_passes",
        default_of="speculators (XPressArgs.consistency_passes, XPressDraftModel.forward)",
        names=("consistency_passes",), flags=("--consistency-passes",), family="xpress")
    base_anchor_weight: float = knob(
        0.6, "XPress: weight of the loss of the backbone's own logits (the Jacobi seed; 0: none)", ge=0,
        speculators="base_anchor_weight",
        default_of="speculators (XPressArgs.base_anchor_weight, XPressDraftModel.forward)",
        names=("base_anchor_weight",), flags=("--base-anchor-weight",), family="xpress")
    base_anchor_full_weight: bool = knob(
        False, "XPress: the backbone's loss unweighted per position (mask only) instead of decayed",
        speculators="base_anchor_full_weight",
        default_of="speculators (XPressArgs.base_anchor_full_weight, XPressDraftModel.forward)",
        names=("base_anchor_full_weight",), flags=("--base-anchor-full-weight/--base-anchor-decayed",),
        family="xpress")
    ce_from_data: bool = knob(
        False, "XPress: the ce term toward the data's tokens instead of the verifier's argmax",
        speculators="ce_from_data", default_of="speculators (XPressArgs.ce_from_data, XPressDraftModel.forward)",
        names=("ce_from_data",), flags=("--ce-from-data/--ce-from-teacher",), family="xpress")
    # The run, not a knob: the hash of the training data and the schedule (steps, lr, ...), recorded as they were.
    data_hash: str = ""
    extra: dict[str, Any] = Field(default_factory=dict)

    def check_trainable(self, num_target_layers: int | None = None) -> None:
        """The rules a recipe must also meet to be trained with; a recipe a checkpoint declares is
        audited as it is, never refused. D-PACE reads the drafter's confidence as exp(-CE), so it
        needs the ce loss (speculators refuses it with KL too); the source layer must exist."""
        if self.per_position_loss_weight == "dpace" and self.loss_fn != "ce":
            raise SpecError("per_position_loss_weight", f"dpace needs loss_fn ce (it reads exp(-CE) as the drafter's "
                                                        f"confidence), got loss_fn {self.loss_fn!r}")
        source = self.verifier_source_layer
        if num_target_layers is not None and source is not None and layers_outside([source], num_target_layers):
            raise SpecError("verifier_source_layer",
                            f"{source} outside {layer_range(num_target_layers)}")

    def replace(self, **changes: Any) -> Recipe:
        """A copy with `changes`, checked like any new recipe."""
        return Recipe(**{**self.to_dict(), **changes})

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump()

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Recipe:
        if not isinstance(data, dict):  # a string would be read as a list of one-letter fields
            raise SpecError("recipe", f"expected a mapping of fields, got {type(data).__name__} {str(data)[:60]!r}")
        data = dict(data)
        if "loss_kind" in data and "loss_fn" not in data:
            data["loss_fn"] = data.pop("loss_kind")  # checkpoints written before the rename
        return cls(**data)


LOSS_KINDS = LOSS_NAMES
LOSS_WEIGHTINGS = get_args(LossWeighting)
# The recipe's declared settings (what a checkpoint can say it was trained with; the run's hash and extras are
# not compared): the one list the vocabulary, the CLI and the audit read.
RECIPE_FIELDS = tuple(name for name, info in Recipe.model_fields.items() if info.json_schema_extra)
KNOBS = {name: Recipe.model_fields[name] for name in RECIPE_FIELDS}
# What a checkpoint that does not say was trained with, and what `dflash-audit train` uses without a flag.
DEFAULTS = {name: info.default for name, info in KNOBS.items()}
TRAIN_DEFAULTS = {name: info.json_schema_extra.get("train_default", info.default) for name, info in KNOBS.items()}


def train_defaults(family: str = "dflash") -> dict[str, Any]:
    """`dflash-audit train`'s defaults for a family: dflash's, except where speculators' trainer resolves the
    family otherwise (`family_defaults`)."""
    return {name: info.json_schema_extra["family_defaults"].get(family, [TRAIN_DEFAULTS[name]])[0]
            for name, info in KNOBS.items()}


# -- loss_fn: speculators' spec --------------------------------------------------------------
def loss_terms(spec: str) -> dict[str, float]:
    """{name: weight} of a loss_fn spec (a name, or a JSON dict of names to weights), as speculators'
    `resolve_loss_config` reads it; ValueError naming what is wrong."""
    if spec in LOSS_NAMES:
        return {spec: 1.0}
    try:
        parsed = json.loads(spec) if isinstance(spec, str) else None
    except (json.JSONDecodeError, RecursionError):
        parsed = None
    if not isinstance(parsed, dict) or not parsed:
        raise ValueError(f"{spec!r} is not one of {list(LOSS_NAMES)} nor a JSON dict of them to weights")
    for name, weight in parsed.items():
        if name not in LOSS_NAMES:
            raise ValueError(f"{spec!r}: {name!r} not in {list(LOSS_NAMES)}")
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight):
            raise ValueError(f"{spec!r}: the weight of {name} must be a finite number")
    return {name: float(weight) for name, weight in parsed.items()}


def canonical_loss_fn(spec: str) -> str:
    """One spelling per loss: a lone name at weight 1 is the name, else the JSON dict as json.dumps writes it."""
    terms = loss_terms(spec)
    if len(terms) == 1 and next(iter(terms.values())) == 1.0:
        return next(iter(terms))
    return json.dumps(terms)


def choices(name: str) -> tuple[Any, ...]:
    """The values a Literal knob takes; () for any other."""
    return settings.choices(KNOBS[name])


def train_recipe(family: str = "dflash") -> Recipe:
    """The recipe `dflash-audit train` records when no recipe flag is given: speculators' trainer resolution
    (dflash: CE + D-PACE), where `Recipe()` is the model-level one (KL + fixed decay)."""
    return Recipe(**train_defaults(family))


def flag_table() -> str:
    """The `train` recipe flags, generated for docs/training.md."""
    lines = ["| flag | setting | type | default (`train`) | range | speculators | z-lab | whose default |",
             "|---|---|---|---|---|---|---|---|"]
    for name, info in KNOBS.items():
        extra = info.json_schema_extra
        allowed = choices(name)
        kind = " \\| ".join(f"`{c}`" for c in allowed) if allowed else _type_name(info.annotation)
        whose = extra.get("train_default_of") or extra["default_of"]
        if "train_default" in extra:
            whose += f"; a checkpoint that does not say: `{info.default}` ({extra['default_of']})"
        for family, (value, of) in extra["family_defaults"].items():
            whose += f"; `--family {family}`: `{value}` ({of})"
        flags = ", ".join(f"`{flag}`" for flag in extra["flags"])
        lines.append(f"| {flags} | `{name}`: {info.description} | {kind} | `{TRAIN_DEFAULTS[name]}` | "
                     f"{settings.range_text(Recipe, name) or '—'} | {_code(extra['speculators'])} | {_code(extra['zlab'])} | "
                     f"{whose} |")
    return "\n".join(lines)


def _type_name(annotation: Any) -> str:
    return {float: "number", int: "integer", bool: "true/false", str: "text"}.get(annotation, "integer or none")


def _code(name: str | None) -> str:
    return f"`{name}`" if name else "—"


if __name__ == "__main__":
    print(flag_table())

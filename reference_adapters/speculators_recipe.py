"""speculators' reference recipes, read from the installed package, never restated.

speculators 0.9.0 has two answers to "how is a DFlash drafter trained by default":

- **model-level** (`MODEL_LEVEL`): the defaults of `DFlashDraftModel.forward` (gamma,
  max_anchors, per_position_loss_weight, dpace_alpha), `compute_metrics`' default loss config
  (KL) and `DFlashSpeculatorConfig.sample_from_anchor`: what the model does when a caller
  passes nothing, shared by every DFlash trainer;
- **TrainConfig-resolved** (`trainer("dflash")`, also `"dflash2"`): what `speculators train
  --speculator-type dflash` actually runs: `TrainConfig(speculator_type=...)` with its
  `_resolve_derived_defaults` (CE, D-PACE, block 16, 5 layers for dflash), flattened and
  handed to the model class's `get_trainer_kwargs`, exactly as `speculators/train/cli.py` does.

Which one a checkpoint without a recipe is held to is `yardstick_for` (the rule is there).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field, replace
from functools import lru_cache
from pathlib import Path

from foundation.packages import installed_version
from impl.recipe import KNOBS, Recipe
from impl.spec import DFLASH2_FIELDS, DSPARK_FIELDS, FAMILY_FIELDS, XPRESS_FIELDS

MODEL_LEVEL = "model-level"
TRAINCONFIG = "trainconfig"


@dataclass(frozen=True)
class ReferenceRecipe:
    name: str  # "model-level" | "trainconfig"
    speculator_type: str  # "dflash", "dflash2"
    recipe: Recipe
    block_size: int | None  # None: the model-level defaults fix no block size of their own
    draft_layers: int | None
    sources: dict[str, str]  # field -> "<file in the speculators package>: <what>"
    # The drafter shape the type resolves beyond block and depth: DFlash2's convolution and
    # selector sizes and `sliding_window_non_causal` (empty for the model-level defaults).
    architecture: dict = field(default_factory=dict)
    # The reduced draft vocabulary it resolves: an int, or None for the verifier's whole vocabulary (no mapping).
    draft_vocab_size: int | None = None
    # (loss_fn, per_position_loss_weight) this reference resolves itself, where `yardstick_for` took the other
    # side's own choice of the two in their place (a setting speculators' TrainConfig accepts); None otherwise.
    replaced_setting: tuple[str, str] | None = None

    @property
    def title(self) -> str:
        which = "model-level defaults" if self.name == MODEL_LEVEL else \
            f"TrainConfig-resolved {self.speculator_type} recipe"
        return f"speculators {installed_version('speculators')} {which}"

    def settings(self) -> dict:
        """Recipe fields plus block size and draft layers: what `train --recipe speculators` takes."""
        values = {name: getattr(self.recipe, name) for name in RECIPE_TABLE_FIELDS}
        values.update(block_size=self.block_size, draft_layers=self.draft_layers)
        return values

    def table_value(self, name: str):
        """A field's value in the table of docs/training.md; None where this reference does not set it."""
        owner = KNOBS[name].json_schema_extra["family"] if name in KNOBS else None
        if owner is not None:  # a family's own knob: only that family's trainer sets it
            return getattr(self.recipe, name) if self.speculator_type == owner else None
        if name == "draft_vocab_size":
            return self.draft_vocab_size if self.draft_vocab_size is not None else "None (the verifier's vocabulary)"
        if name in ARCHITECTURE_TABLE_FIELDS:
            return self.architecture.get(name)
        return self.settings()[name]


# Each family's own knobs and drafter shape (DFlash2's selector weight and convolutions, DSpark's heads, XPress's
# refiner and rounds), after the recipe rows of the table of docs/training.md.
FAMILY_KNOBS = tuple(name for name, info in KNOBS.items() if info.json_schema_extra["family"])
ARCHITECTURE_TABLE_FIELDS = ("sliding_window_non_causal", *FAMILY_KNOBS, *DFLASH2_FIELDS, *DSPARK_FIELDS,
                             *XPRESS_FIELDS)
TABLE_TYPES = ("dflash", "dflash2", "dspark", "xpress")
# The draft vocabulary (#32): the model config's default against the trainer's.
VOCAB_TABLE_FIELDS = ("draft_vocab_size",)
# The fields the reference table (docs/training.md) and the trainer's --recipe flag cover, in that order.
RECIPE_TABLE_FIELDS = ("loss_fn", "per_position_loss_weight", "dpace_alpha", "gamma", "max_anchors",
                       "sample_from_anchor", "verifier_source_layer", "noise_std")


def _file(obj) -> str:
    """`speculators/...py` of an object, relative to site-packages."""
    path = Path(inspect.getsourcefile(obj))
    parts = path.parts
    return "/".join(parts[parts.index("speculators"):])


@lru_cache(maxsize=1)
def model_level() -> ReferenceRecipe:
    from speculators.models.dflash import metrics
    from speculators.models.dflash.config import DFlashSpeculatorConfig
    from speculators.models.dflash.core import DFlashDraftModel

    forward = inspect.signature(DFlashDraftModel.forward).parameters
    core, metrics_file, config_file = _file(DFlashDraftModel), _file(metrics), _file(DFlashSpeculatorConfig)
    recipe = Recipe(
        gamma=float(forward["gamma"].default),
        loss_fn=next(iter(metrics._DEFAULT_LOSS_CONFIG)),
        verifier_source_layer=None,  # verifier_last_hidden_states: the final decoder layer
        noise_std=0.0,
        max_anchors=int(forward["max_anchors"].default),
        sample_from_anchor=bool(DFlashSpeculatorConfig.model_fields["sample_from_anchor"].default),
        per_position_loss_weight=str(forward["per_position_loss_weight"].default),
        dpace_alpha=float(forward["dpace_alpha"].default),
    )
    sources = {
        "gamma": f"{core}: DFlashDraftModel.forward(gamma=...) default",
        "loss_fn": f"{metrics_file}: _DEFAULT_LOSS_CONFIG (compute_metrics without a loss config)",
        "verifier_source_layer": f"{core}: targets from verifier_last_hidden_states (the final layer)",
        "noise_std": f"{core}: DFlashDraftModel adds no hidden-state noise",
        "max_anchors": f"{core}: DFlashDraftModel.forward(max_anchors=...) default",
        "sample_from_anchor": f"{config_file}: DFlashSpeculatorConfig.sample_from_anchor default",
        "per_position_loss_weight": f"{core}: DFlashDraftModel.forward(per_position_loss_weight=...) default",
        "dpace_alpha": f"{core}: DFlashDraftModel.forward(dpace_alpha=...) default",
        "draft_vocab_size": f"{config_file}: DFlashSpeculatorConfig.draft_vocab_size default",
    }
    return ReferenceRecipe(MODEL_LEVEL, "dflash", recipe, None, None, sources,
                           draft_vocab_size=int(DFlashSpeculatorConfig.model_fields["draft_vocab_size"].default))


@lru_cache(maxsize=4)
def trainer(speculator_type: str = "dflash") -> ReferenceRecipe:
    """The recipe `speculators train --speculator-type <type>` resolves with no other flag."""
    import speculators.models.dflash  # noqa: F401  (registers the DFlash family)
    import speculators.models.dflash2  # noqa: F401
    import speculators.models.dspark  # noqa: F401
    import speculators.models.xpress  # noqa: F401
    from speculators.model import SpeculatorModel
    from speculators.train.config.schema import TrainConfig

    from reference_adapters.speculators_adapter import CONFIG_CLASSES

    config = TrainConfig(speculator_type=speculator_type)  # every other field at its default
    flat = config.flatten()
    model_class = SpeculatorModel.registry[speculator_type]
    kwargs, _ = model_class.get_trainer_kwargs(**flat)  # as speculators/train/cli.py calls it
    schema = _file(TrainConfig)
    resolved = f"{schema}: TrainConfig._resolve_derived_defaults (speculator_type={speculator_type})"

    def field_source(group: str, name: str) -> str:
        model = type(getattr(config, group))
        if model.model_fields[name].default is None:
            return resolved  # unset in the schema: filled by the derived-defaults resolution
        return f"{schema}: {model.__name__}.{name} default"

    sample = flat["sample_from_anchor"]
    if sample is None:  # TrainConfig leaves it unset; the model config's default applies
        config_type = CONFIG_CLASSES[speculator_type]
        sample = config_type.model_fields["sample_from_anchor"].default
        sample_source = f"{_file(config_type)}: {config_type.__name__}.sample_from_anchor default " \
                        f"(TrainConfig leaves it unset)"
    else:
        sample_source = field_source("dflash", "sample_from_anchor")
    recipe = Recipe(
        gamma=float(kwargs["gamma"]),
        loss_fn=flat["loss_fn"],  # the spec `get_trainer_kwargs` resolves (a name, or XPress's weighted JSON)
        verifier_source_layer=None,
        noise_std=0.0,
        max_anchors=int(kwargs["max_anchors"]),
        sample_from_anchor=bool(sample),
        per_position_loss_weight=str(kwargs["per_position_loss_weight"]),
        dpace_alpha=float(kwargs["dpace_alpha"]),
    )
    core = _file(model_class)
    sources = {
        "loss_fn": field_source("loss", "loss_fn"),
        "per_position_loss_weight": field_source("dflash", "per_position_loss_weight"),
        "dpace_alpha": field_source("dflash", "dpace_alpha"),
        "gamma": field_source("dflash", "dflash_decay_gamma"),
        "max_anchors": field_source("data", "max_anchors"),
        "sample_from_anchor": sample_source,
        "verifier_source_layer": f"{core}: targets from verifier_last_hidden_states (the final layer)",
        "noise_std": f"{core}: no hidden-state noise",
        "block_size": field_source("dflash", "block_size"),
        "draft_layers": field_source("draft", "num_layers"),
    }
    architecture = {"sliding_window_non_causal": bool(flat["sliding_window_non_causal"])}
    sources["sliding_window_non_causal"] = resolved
    if "selector_loss_alpha" in kwargs:  # a DFlash2 trainer: the selector's loss weight and its shape
        recipe = recipe.replace(selector_loss_alpha=float(kwargs["selector_loss_alpha"]))
        sources["selector_loss_alpha"] = field_source("dflash2", "selector_loss_alpha")
        for name in DFLASH2_FIELDS:
            architecture[name] = int(flat[name])
            sources[name] = field_source("dflash2", name)
    # DSpark's and XPress's own knobs and head shapes, as their `get_trainer_kwargs` / `from_training_args` read them.
    own = {name for name, info in KNOBS.items() if info.json_schema_extra["family"] == speculator_type}
    if own:
        recipe = recipe.replace(**{name: kwargs[name] for name in own})
        sources.update({name: field_source(speculator_type, name) for name in own})
    for name in FAMILY_FIELDS.get(speculator_type, ()) if speculator_type in ("dspark", "xpress") else ():
        architecture[name] = flat[name]
        sources[name] = field_source(speculator_type, name)
    # Unset, the trainer builds no mapping and keeps the verifier's vocabulary (speculators/train/cli.py).
    sources["draft_vocab_size"] = f"{schema}: DraftArgs.draft_vocab_size default"
    return ReferenceRecipe(TRAINCONFIG, speculator_type, recipe, int(flat["block_size"]), int(flat["num_layers"]),
                           sources, architecture, draft_vocab_size=flat["draft_vocab_size"])


def with_own_knobs(reference: ReferenceRecipe, family: str) -> ReferenceRecipe:
    """`reference` with `family`'s own knobs (DFlash2's selector loss weight) as that family's trainer resolves
    them: no DFlash reference sets them, and only speculators' trainer of that family says their value."""
    own = [name for name in FAMILY_KNOBS if KNOBS[name].json_schema_extra["family"] == family]
    if not own:
        return reference
    theirs = trainer(family)
    return replace(reference, recipe=reference.recipe.replace(**{name: getattr(theirs.recipe, name) for name in own}),
                   sources={**reference.sources, **{name: theirs.sources[name] for name in own}})


def yardstick_for(other: Recipe | None, unknown: frozenset[str] | set[str] = frozenset(),
                  family: str = "dflash") -> tuple[ReferenceRecipe, str]:
    """The reference recipe a side without a recipe is held to, and why.

    A DSpark or XPress drafter (`family`) is held to its own family's TrainConfig-resolved recipe (its loss,
    its slot layout and its own knobs are not DFlash's). For DFlash and DFlash2:

    Rule: the TrainConfig-resolved dflash recipe when the other side's recipe trains with one of
    the two settings in which that resolution departs from the model-level defaults — D-PACE
    weighting or CE loss: such a recipe follows speculators' trainer, so its trainer is the
    yardstick. Otherwise (KL with fixed decay, or no recipe at all) the model-level defaults,
    which every DFlash trainer shares. Fields of the other side that are `unknown` (never
    declared) decide nothing. Then the other side's own loss kind and weighting, where it declares
    both and speculators' TrainConfig accepts them (`own_setting`), are taken in the reference's
    place (`replaced_setting` keeps the reference's own): a setting is no divergence; what it leaves
    fixed (gamma under fixed decay, alpha under D-PACE) is still held.
    """
    if family in ("dspark", "xpress"):
        return trainer(family), f"a {family} drafter is held to its own family's trainer recipe"
    reference, why = _dflash_yardstick(other, unknown, family)
    setting = own_setting(other, unknown)
    ref = reference.recipe
    if setting is None or setting == (ref.loss_fn, ref.per_position_loss_weight):
        return reference, why
    loss_fn, weighting = setting
    said = f"{_file(_dflash_args())}: DFlashArgs.per_position_loss_weight, TrainConfig._validate_dpace"
    taken = replace(reference, recipe=ref.replace(loss_fn=loss_fn, per_position_loss_weight=weighting),
                    sources={**reference.sources, "loss_fn": f"the other side's own setting ({said})",
                             "per_position_loss_weight": f"the other side's own setting ({said})"},
                    replaced_setting=(ref.loss_fn, ref.per_position_loss_weight))
    return taken, (f"{why}; its {loss_fn} with {weighting} weights is a setting speculators' TrainConfig accepts for "
                   f"dflash (--loss-fn, --per-position-loss-weight), held as it is, not to "
                   f"{ref.loss_fn} with {ref.per_position_loss_weight}")


def _dflash_yardstick(other: Recipe | None, unknown, family: str) -> tuple[ReferenceRecipe, str]:
    """Which of the two DFlash references, before the other side's own setting is taken (`yardstick_for`)."""
    resolved, base = with_own_knobs(trainer("dflash"), family), with_own_knobs(model_level(), family)
    deciding = [name for name in ("per_position_loss_weight", "loss_fn")
                if getattr(resolved.recipe, name) != getattr(base.recipe, name)]
    if other is not None:
        departures = [name for name in deciding
                      if name not in unknown and getattr(other, name) == getattr(resolved.recipe, name)]
        if departures:
            said = ", ".join(f"{name}={getattr(other, name)}" for name in departures)
            return resolved, f"the other side trains with {said}, as speculators' trainer resolves dflash"
        if all(name in unknown for name in deciding):
            return base, (f"the other side declares neither {' nor '.join(deciding)}; the model-level defaults "
                          "are the ones every DFlash trainer shares")
    return base, "the other side's recipe follows the model-level defaults (KL, fixed decay)"


def _dflash_args():
    from speculators.train.config.schema import DFlashArgs

    return DFlashArgs


def trainer_setting(loss_fn: str, weighting: str) -> bool:
    """Whether speculators' TrainConfig accepts this loss kind and weighting for dflash: the weighting one of its
    `DFlashArgs.per_position_loss_weight` choices, and D-PACE only with CE (`TrainConfig._validate_dpace`, whose
    rule is the recipe type's `check_trainable`). The one rule `compare`'s yardstick and the trace both read."""
    from typing import get_args

    from impl.spec import SpecError

    choices = {a for arg in get_args(_dflash_args().model_fields["per_position_loss_weight"].annotation)
               for a in (get_args(arg) or (arg,)) if isinstance(a, str)}
    if weighting not in choices:
        return False
    try:  # the one home of "D-PACE needs CE": the recipe type's own rule
        Recipe(loss_fn=loss_fn, per_position_loss_weight=weighting).check_trainable()
    except SpecError:
        return False
    return True


def own_setting(other: Recipe | None, unknown: frozenset[str] | set[str] = frozenset()) -> tuple[str, str] | None:
    """The other side's (loss_fn, per_position_loss_weight) where it declares both and they are a setting
    speculators' TrainConfig accepts for dflash (`trainer_setting`): a choice, held as it is, never a divergence
    (CE with fixed decay is as valid as KL with fixed decay or CE with D-PACE). None otherwise."""
    if other is None or {"loss_fn", "per_position_loss_weight"} & set(unknown):
        return None
    setting = (other.loss_fn, other.per_position_loss_weight)
    return setting if trainer_setting(*setting) else None


def reference_table() -> list[dict[str, str]]:
    """Rows of the reference recipe table (docs/training.md): every value with the file it was read from."""
    base, trainers = model_level(), {kind: trainer(kind) for kind in TABLE_TYPES}
    rows = []
    for name in (*RECIPE_TABLE_FIELDS, "block_size", "draft_layers", *ARCHITECTURE_TABLE_FIELDS, *VOCAB_TABLE_FIELDS):
        cells = {"field": name}
        for key, ref in (("model-level", base), *trainers.items()):
            value = ref.table_value(name)
            if name == "verifier_source_layer" and value is None:
                value = "final layer"
            cells[key] = "—" if value is None else str(value)
        cells["source"] = next(ref.sources[name] for ref in trainers.values() if name in ref.sources)
        cells["model_source"] = base.sources.get(name, "— (fixed by the drafter's spec)")
        rows.append(cells)
    return rows


def reference_table_markdown() -> str:
    """The reference recipe table of docs/training.md, generated (tests/test_reference_recipe.py checks it is there verbatim)."""
    lines = ["| field | " + " | ".join(f"TrainConfig `{kind}`" for kind in TABLE_TYPES) + " | model-level (dflash) | "
             "read from (TrainConfig `dflash`, or the one family that sets it) | read from (model-level) |", "|---" * (len(TABLE_TYPES) + 4) + "|"]
    for row in reference_table():
        lines.append(f"| `{row['field']}` | " + " | ".join(row[kind] for kind in TABLE_TYPES) +
                     f" | {row['model-level']} | `{row['source']}` | `{row['model_source']}` |")
    return "\n".join(lines)


def train_settings(speculator_type: str = "dflash") -> dict:
    """The TrainConfig-resolved recipe as `impl.train.RunSettings` fields (`train --recipe speculators`)."""
    ref = trainer(speculator_type)
    recipe = ref.recipe
    if recipe.verifier_source_layer is not None:
        raise ValueError(f"speculators' {speculator_type} recipe reads targets from another layer; our trainer "
                         "does not")
    # Every recipe knob (the source layer is the final one, checked above), a family's own knob only for it.
    family = ref.speculator_type
    settings = {name: getattr(recipe, name) for name, info in KNOBS.items()
                if name != "verifier_source_layer" and info.json_schema_extra["family"] in (None, family)}
    settings.update(block_size=ref.block_size, draft_layers=ref.draft_layers, **ref.architecture)
    return settings

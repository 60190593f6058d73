"""The versions of the plug interface (`impl/interface.py`): what each one added, so that a call a plug cannot
take is named as the interface change it missed, never read as a divergence of the codebase it wraps.

A plug declares the version it implements (`interface_version = N`, a class attribute); one that declares
none was written before versions were named and is read as version 1. Versions 1 to 7 are the interface as
the repository's history shaped it (the commit that made each is named); 8 is the first that plugs declare.
Every later change to `impl/interface.py` adds a version here (tests/test_plug_versions.py holds the table to
the protocol).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Version:
    number: int
    summary: str
    commit: str  # where it entered the repository's history ("" for the one being made)
    operations: tuple[str, ...] = ()  # operations added
    keywords: dict[str, tuple[str, ...]] = field(default_factory=dict)  # operation -> parameters added
    renamed: dict[tuple[str, str], str] = field(default_factory=dict)  # (operation or "recipe", old) -> new name
    recipe_fields: tuple[str, ...] = ()  # fields of a plug's `recipe` the suite compares from this version on


VERSIONS = (
    Version(1, "the first protocol: thirteen operations; a recipe of gamma, loss_kind, max_anchors, noise_std",
            "f1c4bdb",
            operations=("default_target_layer_ids", "context_features", "select_anchors", "training_mask",
                        "inference_mask", "build_drafter", "project_context", "draft_forward", "training_outputs",
                        "loss_weights", "loss", "block_metrics", "generate"),
            recipe_fields=("gamma", "max_anchors", "noise_std", "loss_kind")),
    Version(2, "D-PACE: dpace_weights and dpace_loss; the recipe in speculators' names", "055a7f7",
            operations=("dpace_weights", "dpace_loss"),
            renamed={("recipe", "loss_kind"): "loss_fn"},
            recipe_fields=("loss_fn", "per_position_loss_weight", "dpace_alpha")),
    Version(3, "sampled live decoding: generate takes temperature and seed", "a5722fe",
            keywords={"generate": ("temperature", "seed")}),
    Version(4, "checks downstream of the anchors run on the reference's anchors: training_outputs takes anchors; "
               "TrainingOutputs.target_ids and .unsupported; a case raising Unsupported is n/a", "a64d7e5",
            keywords={"training_outputs": ("anchors",)}),
    Version(5, "DFlash2: dynamic_conv, selector_path, selector_scores, selector_training_candidates, selector_loss; "
               "TrainingOutputs.selector", "6528b82",
            operations=("dynamic_conv", "selector_path", "selector_scores", "selector_training_candidates",
                        "selector_loss")),
    Version(6, "loss parameters in speculators' names: loss(kind -> loss_fn), dpace_*(alpha -> dpace_alpha), "
               "selector_loss(weighting, alpha -> per_position_loss_weight, dpace_alpha)", "990db96",
            renamed={("loss", "kind"): "loss_fn", ("dpace_weights", "alpha"): "dpace_alpha",
                     ("dpace_loss", "alpha"): "dpace_alpha", ("selector_loss", "weighting"): "per_position_loss_weight",
                     ("selector_loss", "alpha"): "dpace_alpha"}),
    Version(7, "slot layout (speculative_tokens, proposal_logits), rotary (apply_rotary, optional), reduced draft "
               "vocabulary (vocab_mapping, proposed_ids)", "563c8d1, f013c08, 582263e",
            operations=("speculative_tokens", "proposal_logits", "apply_rotary", "vocab_mapping", "proposed_ids")),
    Version(8, "versioned plugs: a plug declares interface_version; a call it cannot take is a plug mismatch", "5c04d93"),
    Version(9, "DSpark's and XPress's heads: markov_bias, confidence_logits, markov_path; refiner_bias, jacobi_tokens",
            "3a66ea2",
            operations=("markov_bias", "confidence_logits", "markov_path", "refiner_bias", "jacobi_tokens")),
    Version(10, "DSpark's and XPress's training losses: family_loss (every loss term, speculators' metric names); "
                "TrainingOutputs.family", "",
            operations=("family_loss",)),
)
CURRENT = VERSIONS[-1].number
BY_NUMBER = {version.number: version for version in VERSIONS}
UNDECLARED = 1  # a plug that declares no version predates them all


def operation_added(operation: str) -> int | None:
    return next((v.number for v in VERSIONS if operation in v.operations), None)


def operations() -> tuple[str, ...]:
    """Every operation of the current interface, in the order the versions added them."""
    return tuple(op for version in VERSIONS for op in version.operations)


def keyword_change(operation: str, parameter: str) -> Version | None:
    """The version that added `parameter` to `operation`, or renamed a parameter to it."""
    return next((v for v in VERSIONS if parameter in v.keywords.get(operation, ())
                 or any(key[0] == operation and new == parameter for key, new in v.renamed.items())), None)


def recipe_field_change(name: str) -> Version | None:
    return next((v for v in VERSIONS if name in v.recipe_fields), None)


def renamed_from(version: Version, scope: str, new: str) -> str | None:
    return next((old for (where, old), to in version.renamed.items() if where == scope and to == new), None)


def spec_needs(spec) -> tuple[int, str] | None:
    """The interface version a case needs for the drafter spec it hands a plug, and what that version brought: a
    DFlash2 spec 5, a reduced draft vocabulary 7, DSpark's and XPress's heads 9. An older plug given one cannot
    build it (its `build_drafter` predates the fields): a plug mismatch naming the version, never a divergence."""
    family = getattr(spec, "family", None)
    if family in ("dspark", "xpress"):
        return 9, f"a {family} spec: interface 9 added DSpark's and XPress's heads"
    if family == "dflash2":
        return 5, "a DFlash2 spec: interface 5 added DFlash2 (convolutions and the candidate selector)"
    draft_vocab = getattr(spec, "draft_vocab_size", None)
    if draft_vocab is not None and draft_vocab != getattr(spec, "target_vocab_size", draft_vocab):
        return 7, "a spec with a reduced draft vocabulary: interface 7 added it (vocab_mapping, proposed_ids)"
    return None

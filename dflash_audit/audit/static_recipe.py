"""Static audit, the training recipe: two drafters' recipes compared in speculators' names, each
difference one finding with its catalogue entry."""

from __future__ import annotations

from typing import Any

from catalogue.pitfalls import RECIPE_ENTRIES
from catalogue.findings import Finding
from dflash_audit.audit.sides import Side
from dflash_audit.audit.static_spec import family_of
from impl.layers import final_layer
from impl.recipe import KNOBS, Recipe

# Fields that only mean something under one weighting: compared only when both sides use it
# (under different weightings the one finding is per_position_loss_weight).
WEIGHTING_FIELDS = {"gamma": "fixed-exp-decay", "dpace_alpha": "dpace"}
# A family's own knobs (DFlash2's selector weight, DSpark's confidence weight, XPress's rounds): compared only between
# two drafters of that family (a family difference is one architecture finding, not one per knob).
FAMILY_RECIPE_FIELDS = {name: info.json_schema_extra["family"] for name, info in KNOBS.items()
                        if info.json_schema_extra["family"]}
# The slot layout is the drafter's own: the `slot_layout` finding compares the specs, and each side's recipe
# against its own spec (static_spec.py); comparing the recipes again would report one root cause twice.
DRAFTER_FIELDS = {"sample_from_anchor"}


def recipe_of(side: Side, other: Side) -> tuple[Recipe, dict[str, str], bool, str]:
    """The side's recipe, per-field source, whether it carries one, and what it was held to.

    A side without a recipe is held to one of speculators' reference recipes, chosen by
    `speculators_recipe.yardstick_for` from the other side's recipe (D-PACE or CE there: the
    TrainConfig-resolved dflash recipe; else the model-level defaults). A foreign checkpoint's
    recipe is what it declared; the fields it did not declare are in `side.recipe_unknown` and
    are never compared (the placeholder values are not read)."""
    if side.recipe is not None or side.format == "foreign":
        return side.recipe or Recipe(), {}, True, ""
    from reference_adapters.speculators_recipe import yardstick_for

    reference, why = yardstick_for(other.recipe, set(other.recipe_unknown), family_of(side))
    return reference.recipe, reference.sources, False, f"held to {reference.title}: {why}"


def source_layer(recipe: Recipe, side: Side) -> int | str:
    if recipe.verifier_source_layer is not None:
        return recipe.verifier_source_layer
    depth = side.value("num_target_layers")
    return final_layer(depth) if depth is not None else "the final layer"


def is_final(layer: int | str, side: Side) -> bool:
    depth = side.value("num_target_layers")
    return layer == "the final layer" or (depth is not None and layer == final_layer(depth))


def recipe_findings(ours: Side, ref: Side) -> tuple[list[Finding], dict[str, dict[str, Any]]]:
    if ours.recipe is None and ref.recipe is None and "foreign" not in (ours.format, ref.format):
        note = "neither checkpoint carries a recipe"
        return [], {"ours": {"recipe": None, "source": note}, "ref": {"recipe": None, "source": note}}
    (ro, src_o, has_o, held_o), (rr, src_r, has_r, held_r) = recipe_of(ours, ref), recipe_of(ref, ours)
    unknown = set(ours.recipe_unknown) | set(ref.recipe_unknown)
    found = []
    for name, (pitfall, severity, consequence) in RECIPE_ENTRIES.items():
        if name in unknown or name in DRAFTER_FIELDS:
            continue  # a side that never said it: listed as unknown in the recipe table, not compared
        family = FAMILY_RECIPE_FIELDS.get(name)
        if family and (family_of(ours), family_of(ref)) != (family, family):
            continue  # e.g. a DFlash drafter has no selector to weight
        weighting = WEIGHTING_FIELDS.get(name)
        if weighting and any(weighting != r.per_position_loss_weight for r, side in ((ro, ours), (rr, ref))
                             if "per_position_loss_weight" not in side.recipe_unknown):
            continue  # unused by a side: no finding of its own (a declared value with no declared weighting counts)
        a, b = getattr(ro, name), getattr(rr, name)
        if name == "verifier_source_layer":
            a, b = source_layer(ro, ours), source_layer(rr, ref)
            if is_final(a, ours) and is_final(b, ref):
                continue  # both the final layer, even of targets of different depth
        if a == b:
            continue
        where = ""
        if not has_r:
            where = f" (ref carries no recipe, {held_r}; {src_r[name]})"
        elif not has_o:
            where = f" (ours carries no recipe, {held_o}; {src_o[name]})"
        found.append(Finding("recipe", severity, f"{name}: {a!r} in ours vs {b!r} in ref{where} — {consequence}.",
                             a, b, pitfall=pitfall, key=name))
    recipes = {side_name: recipe_table(side, recipe, sources, has, held)
               for side_name, side, recipe, sources, has, held in (("ours", ours, ro, src_o, has_o, held_o),
                                                                   ("ref", ref, rr, src_r, has_r, held_r))}
    return found, recipes


def recipe_table(side: Side, recipe: Recipe, sources: dict[str, str], has: bool, held: str = "") -> dict[str, Any]:
    values = recipe.to_dict()
    for name in side.recipe_unknown:
        values[name] = "unknown"
    if side.format == "foreign":
        sources = {name: side.provenance.get(f"recipe.{name}", {}).get("detail", "") for name in RECIPE_ENTRIES}
        return {"recipe": values, "source": "declared by the checkpoint (unknown where not declared)",
                "sources": sources}
    return {"recipe": values, "source": "checkpoint" if has else f"reference defaults, {held}", "sources": sources}

"""The loss's recipe from its rows: the loss kind recomputed (KL or cross-entropy against the recorded value), the
reduction's divisor, and, with the weights per slot (weights.py), the whole held to speculators' reference recipe
chosen by `yardstick_for` from what the trainer was found to do.

The stage: `hold_recipe(step, blocks, context, loss, anchors, weights, labels) -> LossRecipe`."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch

from catalogue.findings import Finding
from catalogue.pitfalls import RECIPE_ENTRIES
from dflash_audit.target_values import CHUNK_ROWS
from dflash_audit.trace.step_audit.anchors import Anchors
from dflash_audit.trace.step_audit.blocks import Blocks
from dflash_audit.trace.step_audit.context import Context
from dflash_audit.trace.step_audit.labels import Labels
from dflash_audit.trace.step_audit.loss_fit import REFERENCE_REDUCTION
from dflash_audit.trace.step_audit.loss_rows import LossRows
from dflash_audit.trace.step_audit.reduction import SAME, fit_reduction, optimizer_effect
from dflash_audit.trace.step_audit.state import StepState
from dflash_audit.trace.step_audit.weights import Weights
from impl.recipe import Recipe


@dataclass
class LossRecipe:
    """The loss kind found (speculators' name for it; None: no speculators setting, or the loss not reproduced) and
    the reference recipe it was held to."""
    kind: str | None
    reference: str


def hold_recipe(step: StepState, blocks: Blocks, context: Context, loss: LossRows, anchors: Anchors,
                weights: Weights, labels: Labels) -> LossRecipe:
    """The loss kind recomputed from the rows and its reduction, then the recipe found held to speculators'."""
    kind = loss_kind(step, blocks, context, loss, anchors, weights.fit, labels.source)
    return LossRecipe(kind, recipe_findings(step, weights.fit, kind, labels.source))


def loss_kind(step: StepState, blocks: Blocks, context: Context, loss: LossRows, anchors: Anchors, fit: dict | None,
              label_source: str | None) -> str | None:
    """The loss recomputed from its rows (each row's weight and target, read from the gradient): KL or
    cross-entropy, against the recorded value; its reduction where it is reproduced. The kind: speculators' name
    for it (None: no speculators setting, or not reproduced)."""
    live, trained, hard = loss.live, loss.trained, loss.hard
    recorded = float(step.meta["loss"])
    kl = ce = 0.0
    for start in range(0, len(live), CHUNK_ROWS):  # in chunks of rows: never [rows, vocabulary] in float64
        part = live[start:start + CHUNK_ROWS]
        c = torch.tensor([row[1] for row in part], dtype=torch.float64)
        p = torch.stack([row[2] for row in part]).double()
        lq = torch.stack([row[3] for row in part]).double()
        kl += float((c * (p * (p.clamp_min(1e-30).log() - lq)).sum(-1)).sum())
        ce += float((c * -(p * lq).sum(-1)).sum())
    close = [kind for kind, value in (("kl_div", kl), ("ce", ce))
             if abs(value - recorded) <= 1e-4 * max(1.0, abs(recorded))]
    kind = None
    if hard:  # toward a candidate's argmax: speculators' "ce"; toward the data's tokens: no speculators setting
        kind = "ce" if close and label_source and "argmax" in label_source else None
    elif close:  # soft targets: KL, or the soft-target cross-entropy (KL's gradient, its value KL + entropy)
        kind = "kl_div" if "kl_div" in close else "soft_ce"
    if not close:
        best = min(abs(kl - recorded), abs(ce - recorded)) / max(1e-12, abs(recorded))
        step.findings.append(Finding("loss", "warning", f"the recorded loss {recorded:.6g} is not reproduced as "
                                     f"the weighted sum of its rows' KL or cross-entropy (relative difference "
                                     f"{best:.2g})", recorded, None, pitfall=7, key="unrecognized"))
    else:
        step.flow["loss_kind"] = close[0] if not hard else "ce toward hard labels"
        reduction(step, blocks, context, anchors, fit, live, trained)
    return kind


def reduction(step: StepState, blocks: Blocks, context: Context, anchors: Anchors, fit: dict | None, live: list,
              trained: list) -> None:
    """The reduction as two parts (reduction.py): its scale, one factor on every row of the step (said, with what
    it does under the optimizer recorded), and the relative weight of the sequences' rows, held to the
    reference's sum(w * mask * loss) / (sum(mask) + 1e-5) per sequence, then the mean: a slot-1 row of a sequence
    weighs 1 / (n_sequences * (rows of the sequence + 1e-5)). A sequence is a data row (all its blocks, whatever
    drafter calls or batch elements they were laid out in), where the anchors place it."""
    if fit and fit.get("kind") == "dpace":
        dpace_reduction(step, trained, fit)
        return
    if not fit or fit.get("kind") not in ("uniform", "fixed-exp-decay"):
        return
    per_seq: dict[object, list] = {}
    for slot, c, _, _ in live:
        if slot is not None:
            per_seq.setdefault(sequence_of(step, context, anchors, slot), []).append((slot[3], c))
    if not per_seq:
        return
    block_rows, elements = Counter(), {}
    for slot, _, _, _ in trained:
        if slot is not None:
            elements[slot[:2]] = sequence_of(step, context, anchors, slot)
    for call, block in blocks.calls.items():
        for s in block["slots"]:
            if s is not None and (call, s[0]) in elements:
                block_rows[elements[(call, s[0])]] += 1
    every = Counter(sequence_of(step, context, anchors, slot) for slot, _, _, _ in trained if slot is not None)
    units, counts = [], []
    for key, rows in per_seq.items():
        firsts = [c for k, c in rows if k == 1]
        if not firsts:
            return  # no slot-1 row to read the sequence's divisor from
        units.append(1 / (sum(firsts) / len(firsts)))
        counts.append((len(rows), every.get(key, 0), block_rows.get(key, 0)))
    found = fit_reduction(units, counts)
    n = len(units)
    if found.factor is None:
        weighting_finding(step, units, counts)
    elif abs(found.factor - 1) > SAME:
        unit = units[0] * found.factor
        steps = (step.run_facts.get("steps") or [{}])
        clipped = [c["max_norm"] for c in (steps[min(step.step, len(steps) - 1)].get("clip_calls") or [])
                   if isinstance(c.get("max_norm"), (int, float))]
        optimizers = [o.get("class", "?") for o in (step.run_facts.get("structure") or {}).get("optimizers") or []]
        step.add(Finding("loss_weights", "info", f"the loss's scale: every trained row weighs {found.factor:.4g} "
                         f"times what the reference's reduction gives it (a slot-1 row of the first sequence "
                         f"1/{units[0]:.4g}, the reference's 1/{unit:.4g}, counting {found.count} over {n} "
                         "sequence" + ("s" if n != 1 else "") + "): one factor for the step, so the relative "
                         "weights of rows and positions are the reference's; "
                         + optimizer_effect(found.factor, optimizers, clipped), round(found.factor, 6), 1.0,
                         pitfall=6, key="reduction_scale", raw={"factor": found.factor, "optimizers": optimizers}))


def sequence_of(step: StepState, context: Context, anchors: Anchors, slot: tuple) -> tuple:
    """The sequence a block's row belongs to: its data row where its anchor was placed (anchors.py) or its batch
    element's context named (context.py), else its drafter call's batch row."""
    a = anchors.places.get(slot[:3])
    if a is not None:
        return ("row", a // step.cands.seq_len)
    row = context.element_rows.get(slot[:2])
    return ("row", row) if row is not None else ("element", slot[:2])


def weighting_finding(step: StepState, units: list[float], counts: list[tuple[int, ...]]) -> None:
    """No one factor relates the rows' weights to the reference's: the reduction weighs the sequences otherwise.
    Said with two sequences' numbers: the fewest and the most trained rows (else the lightest and heaviest)."""
    n = len(units)
    order = sorted(range(n), key=lambda i: (counts[i][0], units[i]))
    if counts[order[0]][0] == counts[order[-1]][0]:
        order = sorted(range(n), key=lambda i: units[i])
    a, b = order[0], order[-1]
    alike = max(units) - min(units) <= SAME * max(units)
    how = (" every trained row weighs alike (one divisor for the batch), where the reference weighs each "
           "sequence's mean alike: a sequence weighs in proportion to its trained rows" if alike else "")
    ref_a, ref_b = n * (counts[a][0] + 1e-5), n * (counts[b][0] + 1e-5)
    step.add(Finding("loss_weights", "divergence", f"the loss weighs its sequences unlike the reference: a slot-1 "
                     f"row weighs 1/{units[a]:.4g} in a sequence of {counts[a][0]} trained rows and "
                     f"1/{units[b]:.4g} in one of {counts[b][0]}, where the reference's reduction "
                     f"({REFERENCE_REDUCTION}) gives them 1/{ref_a:.4g} and 1/{ref_b:.4g};{how}",
                     f"1/{units[a]:.4g}, 1/{units[b]:.4g}", f"1/{ref_a:.4g}, 1/{ref_b:.4g}", pitfall=6,
                     key="reduction"), edge="loss")


def dpace_reduction(step: StepState, trained: list, fit: dict) -> None:
    """Under D-PACE each row's divisor is its D-PACE weight over its weight in the loss: speculators' is
    n_sequences * (trained rows of the sequence + 1e-5); one divisor for every row that equals the sum of the
    weights is the loss divided by the sum of its weights."""
    weights = fit["weights"]
    divisors = {i: weights[i] / trained[i][1] for i in weights}
    per_seq = Counter(slot[:2] for slot, c, _, _ in trained if slot is not None and slot[3] >= 1 and c > 0)
    n = len(per_seq)
    expected = {i: n * (per_seq[trained[i][0][:2]] + 1e-5) for i in weights}
    if all(abs(d - expected[i]) <= 1e-3 * d for i, d in divisors.items()):
        return
    total = sum(weights.values())
    spread = max(divisors.values()) - min(divisors.values())
    if spread <= 1e-3 * max(divisors.values()) and abs(next(iter(divisors.values())) - total) <= 1e-3 * total:
        step.add(Finding("loss_weights", "divergence", f"the D-PACE loss is divided by the sum of its weights "
                         f"({total:.4g}, over the step's {len(weights)} trained rows); speculators reduces as "
                         f"{REFERENCE_REDUCTION} (the trained rows, not their weights)", "sum(w)",
                         REFERENCE_REDUCTION, pitfall=18, key="reduction"), edge="loss")
    else:
        step.add(Finding("loss_weights", "warning", f"the D-PACE loss's divisor is not reproduced (from "
                         f"{min(divisors.values()):.4g} to {max(divisors.values()):.4g} over its rows)", None,
                         REFERENCE_REDUCTION, pitfall=18, key="reduction"))


def recipe_findings(step: StepState, fit: dict | None, kind: str | None, label_source: str | None) -> str:
    """The recipe found (loss kind, weighting, gamma) against speculators' reference recipe for it.

    A trace sees the trainer's own choice of the two knobs that pick a recipe (the loss kind and the weighting).
    Each choice that speculators' TrainConfig accepts for dflash (`trainer_setting`) is a setting, not a
    divergence: CE with fixed decay is as valid as KL with fixed decay or CE with D-PACE. What is held is what
    the choice leaves fixed: gamma under fixed decay; a weighting that is no setting (uniform) against the
    reference's."""
    from reference_adapters.speculators_recipe import trainer_setting, yardstick_for

    found: dict[str, Any] = {}
    unknown = set()
    from_data = label_source is not None and label_source.startswith("the data")
    loss_fn = loss_fn_found(kind, label_source)
    if loss_fn:
        found["loss_fn"] = loss_fn
    else:
        unknown.add("loss_fn")  # CE toward the data's tokens is no speculators setting: it decides nothing
    if fit and fit["kind"] == "fixed-exp-decay":
        found["per_position_loss_weight"], found["gamma"] = "fixed-exp-decay", fit["gamma"]
    elif fit and fit["kind"] == "uniform":
        found["per_position_loss_weight"] = "uniform"
        unknown.add("per_position_loss_weight")  # no speculators weighting: it picks no reference
    elif fit and fit["kind"] == "dpace":
        found["per_position_loss_weight"], found["dpace_alpha"] = "dpace", fit["alpha"]
    else:
        unknown.add("per_position_loss_weight")
    recipe = Recipe(**{k: v for k, v in found.items() if (k, v) != ("per_position_loss_weight", "uniform")})
    reference, _ = yardstick_for(recipe, unknown)
    ref = reference.recipe
    step.flow["reference"] = reference.title
    if from_data:  # the targets' source, not the loss kind: the data's tokens instead of the target's
        step.add(Finding("targets", "divergence", "the targets are the data's next tokens (hard labels "
                         "gathered from the input ids): the reference distils the target (its logits, or their "
                         "argmax under cross-entropy) — the drafter learns the data, not what the target would "
                         "accept", "the data's next tokens", "the target's own logits (or their argmax)",
                         pitfall=3, key="target_source"), edge="targets")
    weighting = found.get("per_position_loss_weight")
    said = " (a soft-target cross-entropy: KL's gradient, its value KL plus the target's entropy)" \
        if kind == "soft_ce" else ""
    if weighting == "dpace" and "loss_fn" in found and not trainer_setting(found["loss_fn"], weighting):
        pitfall, severity, consequence = RECIPE_ENTRIES["loss_fn"]
        step.add(Finding("recipe", severity, f"loss_fn: the loss distils the target's whole distribution{said} "
                         f"under D-PACE weights; speculators' TrainConfig takes D-PACE only with {ref.loss_fn} "
                         f"toward the target's argmax ({reference.title}) — {consequence}", found["loss_fn"],
                         ref.loss_fn, pitfall=pitfall, key="loss_fn"), edge="loss")
    elif said:
        step.note("the loss's value is a soft-target cross-entropy, KL plus the target's entropy: its gradient "
                  "is KL's, so it is held as KL")
    if weighting == "dpace":
        dpace_findings(step, fit, ref, reference.title)
    elif weighting and not trainer_setting(found.get("loss_fn", ref.loss_fn), weighting):
        pitfall, severity, consequence = RECIPE_ENTRIES["per_position_loss_weight"]
        step.add(Finding("recipe", severity, f"per_position_loss_weight: the weights are {fit['text']}; "
                         f"{reference.title} uses {ref.per_position_loss_weight} — {consequence}", weighting,
                         ref.per_position_loss_weight, pitfall=pitfall, key="per_position_loss_weight"),
                 edge="loss")
    elif weighting == "fixed-exp-decay" and not math.isclose(found["gamma"], ref.gamma, rel_tol=1e-3):
        pitfall, severity, consequence = RECIPE_ENTRIES["gamma"]
        step.add(Finding("recipe", severity, f"gamma: the weights fit exp(-(k-1)/{found['gamma']:.4g}) to "
                         f"{fit['error']:.1g}: gamma {found['gamma']:.4g} vs {ref.gamma:g} in {reference.title} — "
                         f"{consequence}", round(found["gamma"], 4), ref.gamma, pitfall=pitfall, key="gamma"),
                 edge="loss")
    if reference.replaced_setting is not None:  # the trainer's own setting, taken by the yardstick
        own_loss, own_weighting = reference.replaced_setting
        step.note(f"the loss is {ref.loss_fn} with {ref.per_position_loss_weight} weights, where "
                  f"{reference.title} has {own_loss} with {own_weighting}: a setting speculators' TrainConfig "
                  "accepts for dflash (--loss-fn, --per-position-loss-weight), so the choice is not held as a "
                  "divergence" + ("; its gamma is held" if weighting == "fixed-exp-decay" else ""))
    return reference.title


def dpace_findings(step: StepState, fit: dict, ref, title: str) -> None:
    """D-PACE read by value: its smoothing alpha, and the labels its confidences are taken on (speculators':
    the CE target, the targets' argmax)."""
    if abs(fit["alpha"] - ref.dpace_alpha) > 1e-2:
        pitfall, severity, consequence = RECIPE_ENTRIES["dpace_alpha"]
        step.add(Finding("recipe", severity, f"dpace_alpha: the D-PACE weights fit alpha {fit['alpha']:.3g} vs "
                         f"{ref.dpace_alpha:g} in {title} — {consequence}", round(fit["alpha"], 3),
                         ref.dpace_alpha, pitfall=pitfall, key="dpace_alpha"), edge="loss")
    if fit["source"] != "the targets' argmax":
        step.add(Finding("loss_weights", "divergence", f"the D-PACE confidences are the drafter's probabilities "
                         f"of {fit['source']}, not of the targets' argmax (speculators' D-PACE takes them on its "
                         "CE target): later slots are weighted by how well the drafter predicts the data, not the "
                         "target", fit["source"], "the targets' argmax", pitfall=18, key="dpace_confidence"),
                 edge="loss")


def loss_fn_found(kind: str | None, label_source: str | None) -> str | None:
    """The speculators loss kind a recorded loss is: the soft-target cross-entropy distils the whole distribution, as
    KL; cross-entropy toward the target's argmax is CE; None where it is neither (CE toward the data's tokens)."""
    if kind in ("kl_div", "soft_ce"):
        return "kl_div"
    if kind == "ce" or (kind and label_source and "argmax" in label_source):
        return "ce"
    return None

"""The loss's weights per slot, read from its rows: each slot's weight relative to its block's first trained slot
(the reduction's divisor cancels), fitted to the reference's families (uniform, exp(-(k-1)/gamma): loss_fit.py) or
as D-PACE of the drafter's confidences (dpace_fit.py); a weight on the anchor slot is a divergence. recipe.py holds
the fit to the reference's recipe.

The stage: `read_weights(step, loss, anchors) -> Weights`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from catalogue.findings import Finding
from dflash_audit.trace.step_audit.anchors import Anchors
from dflash_audit.trace.step_audit.loss_fit import fit_weights
from dflash_audit.trace.step_audit.loss_rows import LossRows
from dflash_audit.trace.step_audit.state import StepState


@dataclass
class Weights:
    """The weights per slot, fitted (`fit`: its "kind" (uniform, fixed-exp-decay, dpace, ...), its parameters, its
    "text"); None where no block has two trained slots to fit them on."""
    fit: dict[str, Any] | None


def read_weights(step: StepState, loss: LossRows, anchors: Anchors) -> Weights:
    """Each slot's weight, relative to its block's first trained slot (the reduction's divisor cancels)."""
    trained = loss.trained
    blocks: dict[tuple, dict[int, float]] = {}
    for slot, c, _, _ in trained:
        if slot is not None:
            blocks.setdefault(slot[:3], {})[slot[3]] = c
    ratios: dict[int, list[float]] = {}
    anchor_weight = 0.0
    for per in blocks.values():
        first = min((k for k, c in per.items() if k >= 1 and c > 0), default=None)
        if first is None:
            continue
        for k, c in per.items():
            if k == 0:
                anchor_weight = max(anchor_weight, c / per[first])
            elif c > 0:
                ratios.setdefault(k - first + 1, []).append(c / per[first])
    if not ratios:
        return Weights(None)
    means = {k: sum(v) / len(v) for k, v in sorted(ratios.items())}
    spread = max(max(v) - min(v) for v in ratios.values())
    fit = fit_weights(means)
    step.flow["weights"] = fit["text"]
    if spread > 1e-4:
        dpace = fit_dpace_weights(step, anchors, trained)
        if dpace is not None:
            fit = {"kind": "dpace", "alpha": dpace.alpha, "source": dpace.source, "weights": dpace.weights,
                   "error": dpace.error, "text": f"D-PACE (alpha {dpace.alpha:.3g}, confidences on "
                                                 f"{dpace.source}; fit to {dpace.error:.1g})"}
            step.flow["weights"] = fit["text"]
        else:
            step.add(Finding("loss_weights", "warning", f"the loss weights vary between blocks at the same slot "
                             f"(by {spread:.3g}) and are no D-PACE weighting of the drafter's confidences: a "
                             "per-block weighting or a mask, not fitted", None, None, pitfall=18,
                             key="per_block"))
    if anchor_weight > 0:
        step.add(Finding("loss_weights", "divergence", f"the anchor slot (slot 0) is trained with weight "
                         f"{anchor_weight:.3g} (relative to slot 1); the reference gives it 0 (it is the input, "
                         "not a prediction)", anchor_weight, 0.0, pitfall=6, key="anchor_slot"), edge="loss")
    return Weights(fit)


def fit_dpace_weights(step: StepState, anchors: Anchors, trained: list):
    """The weights as speculators' D-PACE of the drafter's confidences (dpace_fit.py), the confidences taken on
    the targets' argmax (speculators' CE target) or on the data's token at each slot: the first that fits."""
    from dflash_audit.trace.step_audit.dpace_fit import fit_dpace

    tokens = step.cands.tokens.reshape(-1)
    seq = step.cands.seq_len
    blocks: dict[tuple, list] = {}
    for index, (slot, c, p, lq) in enumerate(trained):
        if slot is not None and slot[3] >= 1 and c > 0 and p is not None:
            blocks.setdefault(slot[:3], []).append((slot[3], index, c, p, lq))
    sources = {"the targets' argmax": lambda key, k, p: int(p.argmax())}
    if anchors.places:
        def data_token(key, k, p):
            a = anchors.places.get(key)
            return int(tokens[a + k]) if a is not None and a % seq + k < seq else None

        sources["the data's tokens"] = data_token
    for source, label in sources.items():
        rows = []
        for key, per in blocks.items():
            if sorted(x[0] for x in per) != list(range(1, len(per) + 1)):
                continue  # a block whose rows are not its slots 1.. in full (a row tied to another block's)
            block = []
            for k, index, c, p, lq in sorted(per, key=lambda x: x[0]):
                y = label(key, k, p)
                if y is None:
                    break
                block.append((index, c, -float(lq[y])))
            else:
                rows.append(block)
        fit = fit_dpace(rows, source) if rows else None
        if fit is not None:
            return fit
    return None

"""A loss's reduction read as two parts: its scale (one factor on every row of the step) and the relative weight it
gives rows and positions. The reference (speculators) reduces as sum(w * mask * loss) / (sum(mask) + 1e-5) per
sequence, then the mean: a slot-1 row of a sequence of m trained rows weighs 1 / (n_sequences * (m + 1e-5)).

A trainer that divides by something else (the batch's sum of weights, its row count) but weighs every sequence as the
reference does differs from it by one factor: the gradient's scale, which an Adam-family optimizer normalizes away
(but for eps) and which plain SGD turns into a learning-rate change. Only a difference in the relative weights
changes what the drafter is trained toward."""

from __future__ import annotations

from dataclasses import dataclass

SAME = 1e-3  # relative: one factor for every sequence, within float32 roundings of the gradient
# Optimizers whose update is unchanged when the loss is multiplied by a constant (their eps aside): each normalizes
# the gradient by its own running scale (Adam, RMSprop, Adagrad) or by its norm (Muon's orthogonalization).
SCALE_FREE = {"Adam", "AdamW", "Adamax", "NAdam", "RAdam", "SparseAdam", "Adagrad", "RMSprop", "Muon", "Adafactor"}
SCALED = {"SGD", "ASGD"}  # the update is the gradient times the learning rate
COUNTS = ("its trained rows", "its rows in the loss (weight 0 included)", "its block slots")


@dataclass
class ReductionFit:
    factor: float | None  # each row's weight over the reference's, where one factor holds for every sequence
    count: str | None  # what the reference's sum(mask) counts under that factor


def fit_reduction(units: list[float], counts: list[tuple[int, ...]]) -> ReductionFit:
    """`units`: per sequence, 1 / the weight of its slot-1 rows; `counts`: per sequence, its row counts in the order
    of `COUNTS` (the reference's mask may count any of them). The factor common to every sequence (1 first)."""
    n = len(units)
    common = []
    for which in range(len(COUNTS)):
        factors = [n * (c[which] + 1e-5) / u for u, c in zip(units, counts) if c[which] > 0]
        if len(factors) == n and max(factors) - min(factors) <= SAME * max(factors):
            common.append((sum(factors) / n, COUNTS[which]))
    if not common:
        return ReductionFit(None, None)
    exact = [(f, c) for f, c in common if abs(f - 1) <= SAME]
    return ReductionFit(*(exact or common)[0])


def optimizer_effect(factor: float, optimizers: list[str], clip_norms: list[float]) -> str:
    """What a constant factor on the loss does to the step, under the optimizers recorded."""
    names = list(dict.fromkeys(o.rsplit(":", 1)[-1].rsplit(".", 1)[-1] for o in optimizers))
    free = [o for o in names if o in SCALE_FREE]
    scaled = [o for o in names if o in SCALED]
    other = [o for o in names if o not in SCALE_FREE and o not in SCALED]
    said = []
    if free:
        said.append(f"under {' and '.join(free)} (recorded) it changes nothing but the weight of eps in the update")
    if scaled:
        said.append(f"under {' and '.join(scaled)} (recorded) it multiplies each update by {factor:.4g}: the learning "
                    "rate times that factor (weight decay excepted)")
    if other:
        said.append(f"what it does under {' and '.join(other)} is not known to the audit")
    if not names:
        said.append("no optimizer was recorded: under an Adam-family optimizer it changes nothing but the weight of "
                    "eps, under SGD it is a learning-rate change")
    if clip_norms:
        said.append(f"with the gradient clipped at norm {max(clip_norms):.4g} (recorded), it also moves where "
                    "clipping engages")
    return "; ".join(said)

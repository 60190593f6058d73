"""The learning-rate schedule fitted by value, as loss_fit.py fits the loss weights: from the lr each recorded step
applied, relative to the group's base lr, the warmup (its length, from the slope of a linear rise) and the decay's
shape (linear: equal decrements, the total where it reaches 0; cosine: decrements growing as a cosine's, its total
and floor; constant). What a short run cannot show stays unknown and is said: the decay is not seen while the warmup
lasts, and one decrement fits a line and a cosine alike."""

from __future__ import annotations

import math
from typing import Any

EXACT = 1e-9  # lrs are Python floats: a schedule's values agree to rounding


def _close(a: float, b: float, rel: float = 1e-6) -> bool:
    return abs(a - b) <= rel * max(abs(a), abs(b), 1e-12)


def _cosine_ratio(length: float) -> float:
    """The second decrement over the first of a cosine decay over `length` steps (3 as length grows)."""
    first = 1 - math.cos(math.pi / length)
    return (math.cos(math.pi / length) - math.cos(2 * math.pi / length)) / first


def fit_cosine(decay: list[float]) -> dict | None:
    """decay[0] the peak (1), then f_j = m + (1 - m) * (1 + cos(pi * j / L)) / 2: L and m from the first two
    decrements, then every point checked."""
    if len(decay) < 3:
        return None
    d0, d1 = decay[0] - decay[1], decay[1] - decay[2]
    if d0 <= 0 or d1 <= d0:
        return None
    ratio = d1 / d0
    low, high = 2.0, 1e9
    if not _cosine_ratio(low) <= ratio < 3.0:
        return None
    for _ in range(200):  # the ratio grows with L toward 3
        mid = math.sqrt(low * high)
        if _cosine_ratio(mid) < ratio:
            low = mid
        else:
            high = mid
    length = math.sqrt(low * high)
    floor = 1 - 2 * d0 / (1 - math.cos(math.pi / length))
    error = max(abs(f - (floor + (1 - floor) * (1 + math.cos(math.pi * min(j, length) / length)) / 2))
                for j, f in enumerate(decay))
    if error > 1e-6:
        return None
    return {"length": length, "floor": floor, "error": error}


def fit_schedule(factors: list[float], declared: dict | None = None) -> dict[str, Any]:
    """factors[k]: the lr step k applied over the group's base lr. Returns the warmup (steps, or None), the decay's
    shape ("linear", "cosine", "constant", "other" or None: not seen), the total (where it reaches 0 or its floor;
    None when not seen), their words, and what the run could not show (`unknown`)."""
    fit: dict[str, Any] = {"warmup": None, "warmup_offset": None, "shape": None, "total": None, "total_from": None,
                           "unknown": [], "steps": len(factors)}
    if not factors:
        fit["unknown"].append("no step was recorded")
        return fit
    peak = next((k for k, f in enumerate(factors) if f >= 1 - EXACT), None)
    rise = factors[:peak + 1] if peak is not None else list(factors)
    if peak == 0:
        fit["warmup"] = 0
    elif len(rise) >= 2:
        steps = [b - a for a, b in zip(rise, rise[1:])]
        if all(s > 0 and _close(s, steps[0]) for s in steps):
            warmup = 1 / steps[0]
            if _close(warmup, round(warmup), 1e-6):
                fit["warmup"] = round(warmup)
                fit["warmup_offset"] = round(rise[0] * fit["warmup"])  # 0: transformers' k/w; 1: (k + 1)/w
            else:
                fit["unknown"].append(f"the lr rises by {steps[0]:.4g} of its base per step: not a whole number of "
                                      "warmup steps")
        else:
            fit["unknown"].append("the lr rises, but not linearly: its warmup's shape is not one the fit knows")
    else:
        fit["unknown"].append(f"one step, below the base lr ({factors[0]:.4g} of it): the warmup's length needs two")
    if peak is None:
        if fit["warmup"] is not None and fit["warmup"] > 0:
            fit["unknown"].append(f"the warmup lasts past the {len(factors)} recorded steps: the decay is not seen")
        return _declared(fit, declared)
    decay = factors[peak:]
    hold = 0
    while len(decay) > 2 and abs(decay[1] - decay[0]) <= EXACT and decay[2] < decay[1] - EXACT:
        decay, hold = decay[1:], hold + 1  # held at the peak a step before the decay (a (k + 1)/w warmup's end)
    peak += hold
    if len(decay) < 2:
        fit["unknown"].append(f"the peak is reached at the last recorded step ({peak + 1}): the decay is not seen")
        return _declared(fit, declared)
    drops = [a - b for a, b in zip(decay, decay[1:])]
    if all(abs(d) <= EXACT for d in drops):
        fit["shape"] = "constant"
    elif len(drops) < 2:
        fit["unknown"].append("one step of decay: a line and a cosine fit it alike")
    elif all(d > 0 and _close(d, drops[0]) for d in drops):
        fit.update(shape="linear", total=peak + round(1 / drops[0]), total_from="the decay's slope")
    else:
        cosine = fit_cosine(decay)
        if cosine is not None:
            fit.update(shape="cosine", total=peak + round(cosine["length"]), total_from="the cosine's fit",
                       floor=round(cosine["floor"], 6))
        else:
            fit["shape"] = "other"
    return _declared(fit, declared)


def _declared(fit: dict, declared: dict | None) -> dict:
    """transformers' schedule lambdas name their warmup and total: the total the values did not show, said so."""
    if declared and fit["total"] is None and isinstance(declared.get("num_training_steps"), int):
        fit.update(total=declared["num_training_steps"], total_from="the scheduler's declared num_training_steps")
    if declared:
        fit["declared"] = declared
    return fit


def schedule_text(fit: dict) -> str:
    warmup = "warmup unknown" if fit["warmup"] is None else \
        "no warmup" if fit["warmup"] == 0 else f"linear warmup over {fit['warmup']} steps"
    floor = fit.get("floor", 0.0)
    shape = {"linear": "then linear decay",
             "cosine": f"then cosine decay to {floor:.3g} of the base" if abs(floor) > 1e-6 else "then cosine decay",
             "constant": "then constant", "other": "then a decay of another shape",
             None: "decay not seen"}[fit["shape"]]
    total = f" (total {fit['total']} steps, from {fit['total_from']})" if fit["total"] is not None else ""
    return f"{warmup}, {shape}{total}"

"""The loss side refitted: the recorded loss recomputed under each reduction a trainer may use, and per-slot weights
fitted to the reference's families (uniform, exp(-(k-1)/gamma))."""

from __future__ import annotations

import math
from typing import Any

import torch

REFERENCE_REDUCTION = "sum(w * mask * loss) / (sum(mask) + 1e-5) per sequence, then the mean"


def reductions(per_row: torch.Tensor, weights: torch.Tensor, batch: list[int]) -> list[tuple[str, float]]:
    """The recorded loss recomputed under each reduction a trainer may use, the reference's first (its mask may
    count the anchor slot or not: the same reduction up to a constant per sequence)."""
    weights = weights.float().flatten()
    rows = torch.tensor(batch)
    seqs = sorted(set(batch))

    def per_seq(fn):
        return float(torch.stack([fn(rows == s) for s in seqs]).mean())

    return [(REFERENCE_REDUCTION, per_seq(lambda m: (weights[m] * per_row[m]).sum() / (m.sum() + 1e-5))),
            (REFERENCE_REDUCTION, per_seq(lambda m: (weights[m] * per_row[m]).sum() / ((weights[m] > 0).sum() + 1e-5))),
            ("sum(w * loss) / sum(w) (divided by the sum of the weights)",
             float((weights * per_row).sum() / weights.sum())),
            ("the mean of w * loss", float((weights * per_row).mean())),
            ("the sum of w * loss", float((weights * per_row).sum()))]


def slot_means(w: torch.Tensor, mapping: dict) -> dict[int, float]:
    per_slot: dict[int, list[float]] = {}
    for value, (_, _, k) in zip(w.tolist(), mapping["slots"]):
        if value != 0:
            per_slot.setdefault(k, []).append(value)
    return {k: sum(v) / len(v) for k, v in sorted(per_slot.items())}


def fit_weights(means: dict[int, float]) -> dict[str, Any]:
    """Per-slot weights (slot k -> w) fitted to the reference's families: uniform, or exp(-(k-1)/gamma)."""
    trained = {k: v for k, v in means.items() if k >= 1 and v > 0}
    if not trained:
        return {"kind": "unknown", "text": "no trained slot"}
    first = trained[min(trained)]
    ratios = {k: v / first for k, v in trained.items()}
    if all(abs(r - 1) <= 1e-6 for r in ratios.values()):
        return {"kind": "uniform", "text": f"uniform ({first:.4g} on every trained slot)", "error": 0.0}
    base = min(trained)
    gammas = [-(k - base) / math.log(r) for k, r in ratios.items() if k > base and 0 < r < 1]
    if not gammas:
        return {"kind": "unknown", "text": f"not a decay: {ratios}"}
    gamma = sorted(gammas)[len(gammas) // 2]
    error = max(abs(r - math.exp(-(k - base) / gamma)) for k, r in ratios.items())
    if error > 1e-4:
        return {"kind": "unknown", "text": f"no exponential decay (nearest gamma {gamma:.3g}, off by {error:.2g})"}
    return {"kind": "fixed-exp-decay", "gamma": gamma, "error": max(error, 1e-7),
            "text": f"exp(-(k-1)/{gamma:.4g}) (fit to {max(error, 1e-7):.1g})"}

"""D-PACE weights read by value: per-block weights that vary with the drafter's confidence, refitted with
speculators' own `dpace_loss_decay` (speculators/losses/utils.py) from the confidences the recorded draft rows give.

A block's trained slots k = 1.. carry weights c_k (read from the loss's gradient, each up to the reduction's divisor).
D-PACE computes them from each slot's confidence q_k = exp(-CE_k), the drafter's probability of the slot's label:
smoothed (1 - alpha) q + alpha, multiplied along the block, summed from each slot to the block's end. The label a
confidence is taken on is read, not assumed: the targets' argmax (speculators' CE target) or the data's token at the
slot. The smoothing alpha is fitted; a fit within FIT_TOLERANCE of every block's weights names the weighting.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FIT_TOLERANCE = 1e-3  # the weights, normalised per block, reproduced to this (float32 confidences, summed)


@dataclass
class DpaceFit:
    alpha: float
    error: float  # the largest difference of the per-block normalised weights
    source: str  # which labels the confidences are taken on
    weights: dict  # row index -> the D-PACE weight speculators computes for it (unnormalised)


def dpace_weights(ce: torch.Tensor, mask: torch.Tensor, alpha: float) -> torch.Tensor:
    """speculators' D-PACE weights for blocks [n, L] of per-slot CE (the trained slots only, in order)."""
    from speculators.losses.utils import dpace_loss_decay

    n, length = ce.shape
    return dpace_loss_decay(None, mask.reshape(1, -1), length, alpha, ce.reshape(1, -1)).reshape(n, length)


def fit_dpace(blocks: list[list[tuple[int, float, float]]], source: str) -> DpaceFit | None:
    """`blocks`: per block, its trained slots in order as (row index, weight c, CE of the slot's label). The alpha
    under which speculators' D-PACE weights are proportional to c in every block, or None."""
    blocks = [b for b in blocks if len(b) >= 2]
    if not blocks:
        return None
    length = max(len(b) for b in blocks)
    ce = torch.zeros(len(blocks), length, dtype=torch.float64)
    c = torch.zeros_like(ce)
    mask = torch.zeros_like(ce)
    for i, block in enumerate(blocks):
        for j, (_, weight, loss) in enumerate(block):
            ce[i, j], c[i, j], mask[i, j] = loss, weight, 1.0
    c = c / c.sum(-1, keepdim=True)

    def error(alpha: float) -> float:
        w = dpace_weights(ce.float(), mask.float(), alpha).double() * mask
        w = w / w.sum(-1, keepdim=True)
        return float((w - c).abs().max() / c.max())

    grid = [i / 40 for i in range(1, 41)]
    best = min(grid, key=error)
    lo, hi = max(best - 1 / 40, 1e-4), min(best + 1 / 40, 1.0)
    for _ in range(30):  # golden-section search between the grid's neighbours
        a, b = hi - (hi - lo) / 1.618034, lo + (hi - lo) / 1.618034
        if error(a) <= error(b):
            hi = b
        else:
            lo = a
    alpha = (lo + hi) / 2
    err = error(alpha)
    if err > FIT_TOLERANCE:
        return None
    w = dpace_weights(ce.float(), mask.float(), alpha).double()
    weights = {row: float(w[i, j]) for i, block in enumerate(blocks) for j, (row, _, _) in enumerate(block)}
    return DpaceFit(alpha, err, source, weights)

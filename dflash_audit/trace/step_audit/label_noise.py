"""Hard labels that are a candidate's argmax on most rows but not all: read as the argmax of that candidate's logits
plus Gaussian noise of an unknown std, fitted by maximum likelihood.

A label y of a row with clean logits z is the argmax of z + sigma * e (e standard normal per logit) with probability
    P(y) = E_t [ prod_{j != y} Phi(t + (z_y - z_j) / sigma) ],  t standard normal,
a one-dimensional integral taken by Gauss-Hermite quadrature. The labels' log-likelihood over sigma gives the
estimate and its 95% profile-likelihood interval (where twice the drop from the maximum stays under the chi-square
95% point of one degree of freedom). Hard labels keep only which logit won, so a few dozen flipped rows bound sigma
to an interval, not to a point: the interval is reported with the estimate, and where it is wide the std is said
to be not identifiable, never guessed. The same likelihood, compared across candidates, names the labels' source.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from numpy.polynomial.hermite_e import hermegauss

from dflash_audit.target_values import NOISE_LIMIT

NODES = 32  # Gauss-Hermite nodes: the integrand is smooth in t
CHI2_95 = 3.841  # chi-square, one degree of freedom, 95%
FAR = 10.0  # a logit more than FAR sigmas below the label's never beats it: Phi(t + FAR) is 1 to float precision
IDENTIFIED_RATIO = 2.0  # the std is "identified" when its interval's ends are within this factor of each other


@dataclass
class NoiseFit:
    sigma: float  # the maximum-likelihood std of the noise on the logits
    low: float  # 95% profile-likelihood interval
    high: float
    log_likelihood: float
    flipped: int  # rows whose label is not the clean argmax
    rows: int

    @property
    def identified(self) -> bool:
        return self.low > 0 and math.isfinite(self.high) and self.high / self.low <= IDENTIFIED_RATIO


def log_likelihood(logits: torch.Tensor, labels: torch.Tensor, sigma: float) -> float:
    """log P(labels | logits, sigma) summed over rows (logits [R, V] float64, labels [R])."""
    nodes, weights = hermegauss(NODES)
    t = torch.tensor(nodes, dtype=torch.float64)
    log_w = torch.tensor(weights, dtype=torch.float64).log() - 0.5 * math.log(2 * math.pi)
    gap = (logits.gather(1, labels[:, None]) - logits) / sigma  # [R, V]: the label's lead over each logit
    near = gap < FAR
    near[torch.arange(len(labels)), labels] = False  # the label itself
    rows, cols = near.nonzero(as_tuple=True)
    per_row = torch.zeros(len(labels), NODES, dtype=torch.float64)
    per_row.index_add_(0, rows, torch.special.log_ndtr(gap[rows, cols][:, None] + t[None, :]))
    return float(torch.logsumexp(per_row + log_w, dim=1).sum())


def fit_noise(logits: torch.Tensor, labels: torch.Tensor, interval: bool = True, around: float | None = None) -> NoiseFit:
    """The noise std that best explains `labels` as the argmax of `logits` plus Gaussian noise, with its interval
    (searched up to NOISE_LIMIT of the logits' std: past it the labels are no longer "the candidate plus noise");
    `around` a std found for another candidate: only its neighbourhood is searched, and no interval is taken (a
    likelihood to compare candidates by)."""
    logits, labels = logits.double(), labels.long()
    flipped = int((logits.argmax(-1) != labels).sum())
    scale = float(logits.std())

    seen: dict[float, float] = {}

    def ll(log_sigma: float) -> float:
        if log_sigma not in seen:
            seen[log_sigma] = log_likelihood(logits, labels, math.exp(log_sigma))
        return seen[log_sigma]

    if around is not None:
        grid, interval = [math.log(around) + x for x in (-0.7, -0.35, 0.0, 0.35, 0.7)], False
    else:
        grid = [math.log(scale) + x for x in torch.linspace(math.log(1e-3), math.log(NOISE_LIMIT), 13).tolist()]
    values = [ll(g) for g in grid]
    i = max(range(len(grid)), key=values.__getitem__)
    lo, hi = grid[max(i - 1, 0)], grid[min(i + 1, len(grid) - 1)]
    for _ in range(14 if around is None else 8):  # golden-section search for the maximum between the grid's neighbours
        a, b = hi - (hi - lo) / 1.618034, lo + (hi - lo) / 1.618034
        if ll(a) >= ll(b):
            hi = b
        else:
            lo = a
    best = (lo + hi) / 2
    top = ll(best)
    cut = top - CHI2_95 / 2

    def edge(inside: float, outside: float) -> float:
        if ll(outside) >= cut:
            return outside  # still inside at the grid's end: unbounded on this side
        for _ in range(14):
            middle = (inside + outside) / 2
            inside, outside = (middle, outside) if ll(middle) >= cut else (inside, middle)
        return (inside + outside) / 2

    if not interval:
        return NoiseFit(math.exp(best), math.nan, math.nan, top, flipped, len(labels))
    low, high = edge(best, grid[0]), edge(best, grid[-1])
    return NoiseFit(math.exp(best), 0.0 if low == grid[0] else math.exp(low),
                    math.inf if high == grid[-1] else math.exp(high), top, flipped, len(labels))

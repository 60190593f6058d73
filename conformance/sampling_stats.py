"""Goodness of fit of sampled continuations to the target's own distribution: Pearson's chi-square over
the most probable continuations (each expected at least `MIN_EXPECTED` times) plus one bin for the rest,
with its p-value and its power, from torch alone (the regularized incomplete gamma; a noncentral
chi-square as a Poisson mixture of central ones)."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

import torch

MIN_EXPECTED = 5.0  # Cochran's rule for every bin of a chi-square test


def chi2_sf(x: float, df: int) -> float:
    """P(X > x), X ~ chi-square with `df` degrees of freedom."""
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(x / 2,
                                                                                                  dtype=torch.float64)))


def ncx2_sf(x: float, df: int, noncentrality: float) -> float:
    """P(X > x), X ~ noncentral chi-square: sum_j Poisson(j; λ/2) · P(chi-square(df + 2j) > x), summed over
    the Poisson weights' bulk (mode ± 12 standard deviations)."""
    half = noncentrality / 2
    if half <= 0:
        return chi2_sf(x, df)
    spread = int(12 * math.sqrt(half)) + 20
    total = 0.0
    for j in range(max(0, int(half) - spread), int(half) + spread):
        weight = math.exp(-half + j * math.log(half) - math.lgamma(j + 1))
        total += weight * chi2_sf(x, df + 2 * j)
    return total


def chi2_critical(alpha: float, df: int) -> float:
    low, high = 0.0, 10.0 * df + 100.0
    for _ in range(200):  # bisection: sf is decreasing in x
        mid = (low + high) / 2
        low, high = (mid, high) if chi2_sf(mid, df) > alpha else (low, mid)
    return (low + high) / 2


def detectable_effect(samples: int, df: int, alpha: float, power: float) -> float:
    """Cohen's w the test detects with probability `power` at level `alpha` (w² = λ / samples)."""
    critical = chi2_critical(alpha, df)
    low, high = 0.0, 10.0 * samples
    for _ in range(100):
        mid = (low + high) / 2
        low, high = (mid, high) if ncx2_sf(critical, df, mid) < power else (low, mid)
    return math.sqrt(high / samples)


@dataclass
class FitResult:
    statistic: float
    df: int
    p_value: float
    samples: int
    bins: int
    binned_mass: float  # the target probability held by the named bins (the rest is one bin)
    effect: float  # Cohen's w of the observed frequencies against the target's: sqrt(X² / n)

    def describe(self) -> str:
        return (f"chi-square {self.statistic:.1f} on {self.df} df, p = {self.p_value:.3g} ({self.samples} samples, "
                f"{self.bins} bins holding {self.binned_mass:.0%} of the target's mass + the rest; w = {self.effect:.3f})")


def bins_for(exact: dict[tuple, float], samples: int) -> list[tuple]:
    """Continuations expected at least MIN_EXPECTED times, most probable first."""
    return [k for k, p in sorted(exact.items(), key=lambda kv: -kv[1]) if p * samples >= MIN_EXPECTED]


def goodness_of_fit(observed: list[tuple], exact: dict[tuple, float]) -> FitResult:
    """Pearson's X² of `observed` continuations against `exact` probabilities (missing ones: the rest bin)."""
    n = len(observed)
    named = bins_for(exact, n)
    counts = Counter(observed)
    expected = [exact[k] * n for k in named]
    got = [counts.get(k, 0) for k in named]
    rest_expected = n - sum(expected)
    rest_got = n - sum(got)
    if rest_expected >= MIN_EXPECTED:
        expected.append(rest_expected)
        got.append(rest_got)
    statistic = sum((o - e) ** 2 / e for o, e in zip(got, expected))
    df = len(expected) - 1
    return FitResult(statistic, df, chi2_sf(statistic, df), n, len(named), sum(exact[k] for k in named),
                     math.sqrt(statistic / n))


@torch.no_grad()
def exact_continuations(target, prompt_ids: torch.Tensor, length: int, temperature: float, width: int = 12) -> dict:
    """The target's own probabilities of its `length`-token continuations at `temperature`, for the `width` most
    probable tokens at each step (a beam of all of them): the null distribution. Probabilities are exact; the
    continuations left out only lower the mass the named bins hold."""
    beams = {(): 1.0}
    for _ in range(length):
        prefixes = list(beams)
        ids = torch.cat([prompt_ids.expand(len(prefixes), -1),
                         torch.tensor([list(p) for p in prefixes], dtype=torch.long).reshape(len(prefixes), -1)], 1)
        probs = torch.softmax(target(ids.to(target.device)).logits[:, -1].float() / temperature, dim=-1).cpu()
        top = probs.topk(width, dim=-1)
        beams = {prefix + (int(t),): beams[prefix] * float(p)
                 for prefix, tokens, ps in zip(prefixes, top.indices, top.values) for t, p in zip(tokens, ps)}
    return beams

"""Statistics over per-round acceptance lengths: per-prompt τ, acceptance rates, histograms, noise.

Noise is judged with a paired bootstrap over prompts: the per-prompt differences
τ_ref − τ_ours are resampled with replacement (fixed seed) and the 2.5/97.5 percentiles
of the resampled means form a 95% interval. A gap is beyond noise when that interval
excludes zero. Pairing matters: both drafters see the same prompts, so prompt difficulty
cancels out of the differences.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from impl import decoding

BOOTSTRAP_RESAMPLES = 2000
BOOTSTRAP_SEED = 0
NOISE_METHOD = "paired bootstrap over prompts (2000 resamples, 95% percentile interval of mean τ_ref − τ_ours)"


def tau(rounds: list[int]) -> float:
    return decoding.mean_acceptance(rounds)


def acceptance_histogram(rounds: list[list[int]], longest: int) -> list[int]:
    """How many rounds accepted 0..`longest` tokens (bonus included; longest = speculative tokens + 1), over
    all prompts."""
    return decoding.acceptance_histogram([length for prompt in rounds for length in prompt], longest)


def position_acceptance(rounds: list[list[int]], longest: int) -> list[float]:
    """Fraction of rounds whose k-th proposal (1..longest-1) was accepted: acceptance length > k."""
    flat = [length for prompt_rounds in rounds for length in prompt_rounds]
    if not flat:
        return [0.0] * (longest - 1)
    return [sum(length > k for length in flat) / len(flat) for k in range(1, longest)]


def first_divergent_round(ours: list[int], ref: list[int]) -> int | None:
    """0-based index of the first round whose acceptance lengths differ (None: identical runs)."""
    for i, (a, b) in enumerate(zip(ours, ref)):
        if a != b:
            return i
    return None if len(ours) == len(ref) else min(len(ours), len(ref))


@dataclass
class PairedInterval:
    mean: float  # mean of τ_ref − τ_ours over prompts
    low: float
    high: float
    n: int
    method: str = NOISE_METHOD

    @property
    def beyond_noise(self) -> bool:
        return self.n >= 2 and (self.low > 0 or self.high < 0)


def paired_bootstrap(differences: list[float]) -> PairedInterval:
    n = len(differences)
    mean = sum(differences) / n if n else 0.0
    if n < 2:
        return PairedInterval(mean, mean, mean, n)
    rng = random.Random(BOOTSTRAP_SEED)
    means = sorted(sum(rng.choices(differences, k=n)) / n for _ in range(BOOTSTRAP_RESAMPLES))
    return PairedInterval(mean, means[int(0.025 * BOOTSTRAP_RESAMPLES)], means[int(0.975 * BOOTSTRAP_RESAMPLES) - 1], n)

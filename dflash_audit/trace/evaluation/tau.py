"""Which τ an evaluator's own number is, by value, and how far it is from z-lab's.

Each τ method is computed on the evaluator's rebuilt rounds (and z-lab's loop run without stop ids): the mean of
per-prompt means with the bonus token (z-lab's), pooled rounds, either without the bonus, teacher-forced on the
evaluator's own fixed text, cut at no stop id. The evaluator's number (`trace.tau`) is named by the one it equals. Its
gap to z-lab's τ (z-lab's loop, mean of per-prompt means with the bonus) carries the paired bootstrap interval over
prompts the τ findings use (dflash_audit/audit/tau_stats.py: same resamples, seed and percentiles), here of the
named statistic against z-lab's on the same resampled prompts.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

from dflash_audit.audit.tau_stats import BOOTSTRAP_RESAMPLES, BOOTSTRAP_SEED, PairedInterval
from dflash_audit.rounds.match import per_position

MATCH = 5e-3  # a figure printed to two decimals is within half its last digit of the value it rounds
ZLAB = "z-lab's: the mean of per-prompt means, the bonus token counted"


def mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def mean_of_means(rounds: list[list[int]], bonus: bool = True) -> float:
    return mean([mean([n - (0 if bonus else 1) for n in r]) for r in rounds if r])


def pooled(rounds: list[list[int]], bonus: bool = True) -> float:
    flat = [n - (0 if bonus else 1) for r in rounds for n in r]
    return mean(flat)


@dataclass
class Method:
    name: str
    statistic: Callable[[list[int]], float]  # prompt indices -> the value over those prompts
    per_prompt: list[float] | None  # the per-prompt value (None: pooled, no per-prompt form)


def methods(their: list[list[int]], zlab_unstopped: list[list[int]] | None, fixed_text: bool) -> list[Method]:
    pick = lambda rounds: (lambda idx: [rounds[i] for i in idx])  # noqa: E731
    theirs = pick(their)
    found = [Method(ZLAB + (", on the evaluator's fixed text (teacher-forced)" if fixed_text else ""),
                    lambda idx: mean_of_means(theirs(idx)), [mean(r) for r in their]),
             Method("pooled rounds (all rounds of all prompts together), the bonus counted",
                    lambda idx: pooled(theirs(idx)), None),
             Method("the mean of per-prompt means without the bonus token", lambda idx: mean_of_means(theirs(idx), False),
                    [mean([n - 1 for n in r]) for r in their]),
             Method("pooled rounds without the bonus token", lambda idx: pooled(theirs(idx), False), None)]
    if zlab_unstopped is not None:
        unstopped = pick(zlab_unstopped)
        found.append(Method("z-lab's loop cut at no stop id (run to the evaluator's length)",
                            lambda idx: mean_of_means(unstopped(idx)), [mean(r) for r in zlab_unstopped]))
    return found


def paired_statistic(n: int, statistic: Callable[[list[int]], float]) -> PairedInterval:
    """The paired bootstrap of tau_stats over prompts, of any statistic of the resampled prompts."""
    everyone = list(range(n))
    value = statistic(everyone)
    if n < 2:
        return PairedInterval(value, value, value, n)
    rng = random.Random(BOOTSTRAP_SEED)
    values = sorted(statistic(rng.choices(everyone, k=n)) for _ in range(BOOTSTRAP_RESAMPLES))
    return PairedInterval(value, values[int(0.025 * BOOTSTRAP_RESAMPLES)],
                          values[int(0.975 * BOOTSTRAP_RESAMPLES) - 1], n)


@dataclass
class TauIdentity:
    given: float | list[float] | None
    named: list[str]  # the methods it equals (empty: none)
    nearest: str | None
    value: float | None  # the given number (a per-prompt list: its mean)
    zlab: float
    their_rounds: float  # z-lab's method on the evaluator's rounds
    gap: PairedInterval  # their figure's statistic minus z-lab's, paired over prompts
    candidates: dict[str, float]

    def sentence(self) -> str:
        if self.given is None:
            return (f"the evaluator handed over no τ (trace.tau); its rounds give {self.their_rounds:.4g} by z-lab's "
                    f"method, against z-lab's loop {self.zlab:.4g}: {_gap(self.gap)}")
        what = " = ".join(self.named) if self.named else f"no τ method (nearest: {self.nearest})"
        return (f"their τ {self.value:.4g} is {what}; z-lab's τ is {self.zlab:.4g}: {_gap(self.gap)}")


def _gap(gap: PairedInterval) -> str:
    return (f"differs by {gap.mean:+.4g} (95% paired bootstrap interval [{gap.low:+.4g}, {gap.high:+.4g}] over "
            f"{gap.n} prompt{'s' if gap.n != 1 else ''}, {'beyond' if gap.beyond_noise else 'within'} noise)")


def identify(given, their: list[list[int]], zlab: list[list[int]], zlab_unstopped: list[list[int]] | None,
             fixed_text: bool, last_unknown: int | None = None) -> TauIdentity:
    """Name the evaluator's number by value among the τ methods on its rounds. `last_unknown` (T > 0): each
    prompt's last round is not observed, only that it added 1..last_unknown tokens; a method is named when the
    number lies within what it gives over that range."""
    found = methods(their, zlab_unstopped, fixed_text)
    values = {m.name: m.statistic(list(range(len(their)))) for m in found}
    if last_unknown is not None and isinstance(given, (int, float)):
        low = methods([r[:-1] + [1] for r in their], None, fixed_text)
        high = methods([r[:-1] + [last_unknown] for r in their], None, fixed_text)
        everyone = list(range(len(their)))
        named = [lo.name for lo, hi in zip(low, high)
                 if lo.statistic(everyone) - MATCH <= float(given) <= hi.statistic(everyone) + MATCH]
        gap = paired_statistic(len(their), lambda idx: found[0].statistic(idx) - mean_of_means([zlab[i] for i in idx]))
        return TauIdentity(given, named, None, float(given), mean_of_means(zlab), values[found[0].name], gap, values)
    zlab_value = mean_of_means(zlab)
    named, nearest, value, chosen = [], None, None, found[0]
    if isinstance(given, list):
        value = mean(given)
        if len(given) == len(their):
            for m in found:
                if m.per_prompt is not None and all(abs(a - b) <= MATCH for a, b in zip(given, m.per_prompt)):
                    named.append(m.name)
        distance = {m.name: max((abs(a - b) for a, b in zip(given, m.per_prompt)), default=0.0)
                    for m in found if m.per_prompt is not None and len(given) == len(m.per_prompt)}
        nearest = min(distance, key=distance.get) if distance else None
    elif given is not None:
        value = float(given)
        named = [name for name, v in values.items() if abs(v - value) <= MATCH]
        nearest = min(values, key=lambda name: abs(values[name] - value))
    if named:
        chosen = next(m for m in found if m.name == named[0])
    everyone_zlab = lambda idx: mean_of_means([zlab[i] for i in idx])  # noqa: E731
    gap = paired_statistic(len(their), lambda idx: chosen.statistic(idx) - everyone_zlab(idx))
    return TauIdentity(given, named, nearest, value, zlab_value, values[found[0].name], gap, values)


Drafted = list[list[tuple[int, int]]]  # per prompt, per round: (tokens it added, the bonus counted; tokens it drafted)


def acceptance(rounds: Drafted, positions: int) -> list[float | None]:
    """Acceptance per draft position k = 1..positions over every prompt's rounds, the rounds core's one definition
    (`rounds.match.per_position`: over the rounds that drafted position k; None where none did)."""
    flat = [pair for prompt in rounds for pair in prompt]
    return per_position([n for n, _ in flat], [d for _, d in flat], positions)


def position_gaps(their: Drafted, zlab: Drafted, positions: int) -> list[PairedInterval | None]:
    """At T > 0 a first parting round is undefined: per draft position, the evaluator's acceptance rate against
    z-lab's loop on the same prompts. Both are samples: each resample draws every prompt's rounds again, with
    replacement, on each side (a bootstrap stratified by prompt, same resamples, seed and percentiles as the τ
    findings'), and the 95% interval of the rate difference is read from them (from the resamples where both sides
    drafted the position; None: a position one side never drafted)."""
    def gaps(a: Drafted, b: Drafted) -> list[float | None]:
        return [None if x is None or y is None else x - y
                for x, y in zip(acceptance(a, positions), acceptance(b, positions))]

    rng = random.Random(BOOTSTRAP_SEED)
    resampled = []
    for _ in range(BOOTSTRAP_RESAMPLES):
        resampled.append(gaps([rng.choices(r, k=len(r)) if r else [] for r in their],
                              [rng.choices(r, k=len(r)) if r else [] for r in zlab]))
    found: list[PairedInterval | None] = []
    for k, gap in enumerate(gaps(their, zlab)):
        values = sorted(g[k] for g in resampled if g[k] is not None)
        found.append(None if gap is None or not values else PairedInterval(
            gap, values[int(0.025 * len(values))], values[int(0.975 * len(values)) - 1], len(their),
            "bootstrap of rounds within each prompt, both sides (2000 resamples, 95% percentile interval of the "
            "acceptance-rate gap)"))
    return found

"""Sampled (T > 0) rounds: what a config key that changes only sampled drafts costs, predicted and served.

At T > 0 no two runs share their rounds (the engine's random streams are not the audit's), so the rounds are not held
one by one as at greedy: the audit's prediction is a mean τ with its interval, and the engine's served τ over its own
seeded generations is held to it.

The audit's side is z-lab's loop at temperature T (`impl.decoding.dflash_decode`, seeded): each proposal drawn from
the drafter's softmax(logits / T), kept with probability min(1, p / q), the first rejected one replaced from
max(0, p - q), the bonus drawn from the target's distribution. That is vLLM's rule with
`draft_sample_method: probabilistic` (v1/spec_decode/llm_base_proposer.py `compute_probs_and_sample_next_token`: the
drafts drawn from softmax(draft logits / T); v1/sample/rejection_sampler.py: a draft kept where
p / q >= u, the recovered token drawn from max(p - q, 0)). Every round drafts the whole block, as the engine does,
its proposals cut to what is left (`whole_blocks`), where z-lab's loop shrinks the block near the budget's end.

The interval: τ per generation, averaged per prompt over its seeds, the prompts averaged; its standard error from the
spread across seeds within each prompt (stratified by prompt: every side runs the same prompts), and a 95% Student t
interval (± t·se, its degrees of freedom Satterthwaite's over the prompts: a few seeds' spread is itself uncertain,
and a normal interval would be too narrow). The cost of a reading is paired: the drafter as the reference runs it and
as the engine reads it replayed with the same seeds, the difference per generation. The served τ is inside the
prediction where |served − predicted| <= t·sqrt(se_predicted² + se_served²) (Welch's degrees of freedom): the
interval a served mean over that many generations falls in, 95 times in 100, if the engine runs the drafter as
predicted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from catalogue.findings import Finding
from dflash_audit.rounds.engine_reading import EngineReading, reading_finding

INTERVAL_METHOD = ("95% Student t interval of mean τ over prompts (each prompt's mean over its seeds), the standard "
                   "error from the spread across seeds within each prompt")


def t95(df: float) -> float:
    """The two-sided 95% quantile of Student's t with `df` degrees of freedom (rounded down to whole ones, which
    widens the interval): bisection on its distribution's closed form for whole degrees of freedom (Abramowitz and
    Stegun 26.7.3-4), so no statistics package is needed."""
    nu = max(1, math.floor(df))

    def inside(t: float) -> float:  # P(|T| < t)
        theta = math.atan(t / math.sqrt(nu))
        c2, term, total = math.cos(theta) ** 2, 1.0, 1.0
        if nu % 2 == 0:  # sin θ (1 + 1/2 cos²θ + 1·3/(2·4) cos⁴θ + ...), nu/2 terms
            for k in range(1, nu // 2):
                term *= c2 * (2 * k - 1) / (2 * k)
                total += term
            return math.sin(theta) * total
        if nu == 1:
            return 2 * theta / math.pi
        for k in range(1, (nu - 1) // 2):  # 2/π (θ + sin θ cos θ (1 + 2/3 cos²θ + 2·4/(3·5) cos⁴θ + ...))
            term *= c2 * (2 * k) / (2 * k + 1)
            total += term
        return 2 / math.pi * (theta + math.sin(theta) * math.cos(theta) * total)

    low, high = 1.9, 20.0  # t95 is 12.71 at one degree of freedom, 1.96 at infinity
    for _ in range(60):
        middle = (low + high) / 2
        low, high = (middle, high) if inside(middle) < 0.95 else (low, middle)
    return (low + high) / 2


@dataclass(frozen=True)
class TauInterval:
    """Mean τ over prompts (each its seeds' mean), its standard error, degrees of freedom and 95% interval, over `runs`
    generations."""

    mean: float
    se: float
    df: float
    runs: int
    prompts: int

    @property
    def half_width(self) -> float:
        return t95(self.df) * self.se

    @property
    def low(self) -> float:
        return self.mean - self.half_width

    @property
    def high(self) -> float:
        return self.mean + self.half_width

    def to_dict(self) -> dict[str, Any]:
        return {"tau": round(self.mean, 4), "se": round(self.se, 4), "df": round(self.df, 1),
                "interval": [round(self.low, 4), round(self.high, 4)], "runs": self.runs, "prompts": self.prompts}


def stratified(per_prompt: list[list[float]]) -> TauInterval:
    """The interval of τ values `per_prompt` (each prompt's, one per seed: at least two each)."""
    if not per_prompt or any(len(values) < 2 for values in per_prompt):
        raise ValueError("a sampled τ interval needs every prompt run with at least two seeds")
    means = [sum(values) / len(values) for values in per_prompt]
    # each prompt's share of the mean's variance: its seeds' variance over their count, over prompts²
    shares = [sum((v - m) ** 2 for v in values) / (len(values) - 1) / len(values) / len(means) ** 2
              for values, m in zip(per_prompt, means, strict=True)]
    variance = sum(shares)
    whole = sum(len(values) - 1 for values in per_prompt)
    df = variance ** 2 / sum(share ** 2 / (len(values) - 1) for share, values in zip(shares, per_prompt, strict=True)
                             ) if variance > 0 else whole
    return TauInterval(sum(means) / len(means), math.sqrt(variance), df, sum(len(values) for values in per_prompt),
                       len(per_prompt))


def welch(a: TauInterval, b: TauInterval) -> float:
    """Half the width of the 95% interval of a − b (two independent means): Welch's degrees of freedom."""
    variance = a.se ** 2 + b.se ** 2
    if variance == 0:
        return 0.0
    df = variance ** 2 / ((a.se ** 4 / a.df if a.se else 0) + (b.se ** 4 / b.df if b.se else 0))
    return t95(df) * math.sqrt(variance)


def by_prompt(values: list[Any], samples: int) -> list[list[Any]]:
    """A prompt-major flat list (each prompt's `samples` generations in a row) as one list per prompt."""
    if samples < 1 or len(values) % samples:
        raise ValueError(f"{len(values)} generations are not whole prompts of {samples}")
    return [values[i:i + samples] for i in range(0, len(values), samples)]


def sampled_replay(drafter, target, prompts: list[dict], max_new_tokens: int, stop_ids: list[int],
                   temperature: float, seeds: list[int]) -> list[list[float]]:
    """τ per prompt per seed: z-lab's loop at `temperature`, seeded, whole blocks drafted (the engine's way)."""
    import torch

    from impl.decoding import dflash_decode

    return [[dflash_decode(drafter, target, torch.tensor([p["ids"]]), max_new_tokens, stop_ids,
                           temperature=temperature, seed=seed, whole_blocks=True).tau for seed in seeds]
            for p in prompts]


@dataclass
class SampledPrediction:
    """The audit's sampled τ: the drafter as the folder's reference runs it (`audited`) and as the engine reads the
    folder (`predicted`, None where the reading changes nothing), τ per prompt per seed, at `temperature`."""

    reading: EngineReading
    audited: list[list[float]]
    predicted: list[list[float]] | None
    temperature: float
    seeds: list[int]
    engine: str = "the engine"

    @property
    def expected(self) -> list[list[float]]:
        """What the engine's runs are predicted to give: the reading's replay, else the drafter as trained."""
        return self.audited if self.predicted is None else self.predicted

    def cost(self) -> TauInterval:
        """τ the readings cost, paired by prompt and seed (audited − predicted); none without a reading."""
        return stratified([[a - p for a, p in zip(audited, expected, strict=True)]
                           for audited, expected in zip(self.audited, self.expected, strict=True)])

    def held(self, served: list[list[float]], comparable: bool = True) -> dict[str, Any]:
        """The served τ (per prompt per seed) held to the prediction: both intervals, the predicted cost, and whether
        the served mean is inside the interval a served mean over as many generations is predicted to fall in (None,
        unknown, where the engine is known not to sample at the request's temperature: not `comparable`)."""
        audited, expected, got = stratified(self.audited), stratified(self.expected), stratified(served)
        spread = welch(expected, got)
        cost = self.cost()
        return {"temperature": self.temperature, "draft_sample_method": "probabilistic",
                "replay_seeds": list(self.seeds), "method": INTERVAL_METHOD,
                "audited_tau": audited.to_dict(), "predicted_tau": expected.to_dict(), "served_tau": got.to_dict(),
                "predicted_cost": cost.to_dict(), "served_cost": round(audited.mean - got.mean, 4),
                "served_interval": [round(expected.mean - spread, 4), round(expected.mean + spread, 4)],
                "served_as_predicted": abs(got.mean - expected.mean) <= spread if comparable else None}

    def verdict(self, held: dict[str, Any]) -> str:
        """The served τ against the interval predicted for it, in words (`held`: `self.held`'s)."""
        got, (low, high) = held["served_tau"], held["served_interval"]
        verdict = {True: "inside", False: "outside", None: "not held to"}[held["served_as_predicted"]]
        return (f"vLLM served τ {got['tau']:.3f} [{got['interval'][0]:.3f}, "
                f"{got['interval'][1]:.3f}] over {got['runs']} seeded generations, {verdict} the interval predicted "
                f"for it [{low:.3f}, {high:.3f}] (predicted τ {held['predicted_tau']['tau']:.3f})")

    def findings(self, served: list[list[float]], comparable: bool = True) -> list[Finding]:
        """The readings with their sampled cost and the served figure, where the engine reads a key otherwise (a
        served τ outside the prediction is the section's verdict, `live_report.live_findings`'s finding)."""
        if not self.reading.changes:
            return []
        held = self.held(served, comparable)
        predicted, cost = held["predicted_tau"], held["predicted_cost"]
        return [reading_finding(self.reading, self.engine,
                                f"at temperature {self.temperature:g}, z-lab's loop replayed with the drafter as the "
                                f"engine reads it predicts τ {predicted['tau']:.3f} [{predicted['interval'][0]:.3f}, "
                                f"{predicted['interval'][1]:.3f}] where the drafter as trained gives "
                                f"{held['audited_tau']['tau']:.3f}: a cost of {cost['tau']:.3f} "
                                f"[{cost['interval'][0]:.3f}, {cost['interval'][1]:.3f}]; {self.verdict(held)}",
                                cost["tau"])]

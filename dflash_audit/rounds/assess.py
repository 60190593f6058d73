"""The one assessment: any source's rounds held to the audit's replay of z-lab's loop, prompt by prompt, and the
first round of each prompt that parts localized by the source's own localizer.

The replay is run by the caller (`replay.zlab_replay`) with the same prompts and the same stop ids the source ran
with; `assess` only compares and localizes, so one replay serves a source's every variant (an engine's planted runs).
Where the engine reads a key of the drafter's folder otherwise than the reference (`engine_reading.py`), a second
replay, of the drafter as the engine reads it, is the prediction: each prompt's rounds are held to it too, a parting
the prediction reproduces is the readings' (their τ cost named), and what parts from the prediction is localized
against it.
Findings stay `Finding` records (merged: one per root cause, the prompts and rounds it explains listed) until a
report writes them.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from catalogue.findings import Finding
from dflash_audit.rounds.match import match_rounds, per_position
from dflash_audit.rounds.source import RoundSource

if TYPE_CHECKING:
    from dflash_audit.rounds.engine_reading import Prediction


# The words that name a finding's rounds when it was localized against the prediction (live_report.place_words).
PARTING_FROM_PREDICTION = "first round parting from the prediction of"


@dataclass
class Assessment:
    rows: list[dict[str, Any]]  # per prompt: τ both sides, rounds compared/equal, the first parting round, ...
    per_position: dict[str, list[float]]  # {"served": [...], "audited": [...]}: acceptance per draft position
    findings: list[Finding] = field(default_factory=list)
    greedy_identical: bool | None = None  # every prompt's output the target's own greedy one (None: not known)

    def section(self) -> dict[str, Any]:
        """The live sections' words (`serving.<engine>.live`): prompts, per_position, findings (records),
        greedy_identical."""
        return {"prompts": self.rows, "per_position": self.per_position, "findings": self.findings,
                "greedy_identical": self.greedy_identical}


def merge(findings: list[Finding]) -> list[Finding]:
    """One finding per (kind, what, what its rounds are): the prompts and rounds it explains listed."""
    merged: dict[tuple, Finding] = {}
    for f in findings:
        key = (f.kind, f.key, f.localized.get("at"))
        if key not in merged:
            merged[key] = replace(f, localized={**f.localized, "prompts": [], "rounds": []})
        merged[key].localized["prompts"].append(f.localized["prompt"])
        merged[key].localized["rounds"].append(f.localized["round"])
    return list(merged.values())


def assess(source: RoundSource, audited: list, greedy: list[list[int]] | None = None,
           prediction: Prediction | None = None) -> Assessment:
    """`source`'s prompts against `audited` (one `impl.decoding.DecodeResult` per prompt, the same order); `greedy`:
    the target alone's output per prompt, where known, which speculation must never change; `prediction`: the replay
    of the drafter as the engine reads its folder (its runs in the same order), whose rounds the source should give."""
    k = source.speculative_tokens
    rows, findings = [], []
    served_all, served_k, audited_all, audited_k = [], [], [], []
    predicted_all, predicted_k = [], []
    for p, (prompt, run) in enumerate(zip(source.prompts, audited, strict=True)):
        a_rounds, a_blocks = run.acceptance_lengths, run.extra["proposals"]
        match = match_rounds(prompt.rounds, prompt.blocks, a_rounds, a_blocks, k)
        served_all += prompt.rounds
        audited_all += a_rounds
        if prompt.blocks is not None:  # acceptance per position over the rounds that drafted it, each side's own
            served_k += [len(b) for b in prompt.blocks[:len(prompt.rounds)]]
            served_k += [k] * (len(prompt.rounds) - len(prompt.blocks))
            audited_k += [len(b) for b in a_blocks]
        else:  # a source that does not say what it drafted: K in every round, on both sides alike
            served_k += [k] * len(prompt.rounds)
            audited_k += [k] * len(a_rounds)
        row = {"id": prompt.id, "prompt_tokens": len(prompt.prompt_ids), "served_tau": round(prompt.tau, 4), "audited_tau": round(run.tau, 4),
               "rounds": match.rounds, "rounds_equal": match.rounds_equal, "first_diff_round": match.first_diff_round,
               "served_rounds": list(prompt.rounds), "audited_rounds": list(a_rounds)}
        if prompt.blocks is not None:
            row.update(blocks_equal=match.blocks_equal, last_block_apart=match.last_block_apart,
                       rounds_apart=match.apart)
        if greedy is not None:
            row["greedy_identical"] = (prompt.output == greedy[p]) if p < len(greedy) else None
        row.update(prompt.facts)
        against, parting = run, match.first_diff_round  # what a parting round is localized against
        if prediction is not None:
            forecast = prediction.runs[p]
            f_rounds, f_blocks = forecast.acceptance_lengths, forecast.extra["proposals"]
            predicted = match_rounds(prompt.rounds, prompt.blocks, f_rounds, f_blocks, k)
            predicted_all += f_rounds
            predicted_k += [len(b) for b in f_blocks] if prompt.blocks is not None else [k] * len(f_rounds)
            row.update(predicted_tau=round(forecast.tau, 4), predicted_rounds=list(f_rounds),
                       rounds_equal_predicted=predicted.rounds_equal,
                       first_diff_round_predicted=predicted.first_diff_round, rounds_apart_predicted=predicted.apart)
            if parting is not None and (predicted.first_diff_round is None or predicted.first_diff_round > parting):
                reading = prediction.finding(prompt.id, parting)  # the engine's reading reproduces the parting
                findings.append(reading)
                row["explained_by"] = [reading.key]
            against, parting = forecast, predicted.first_diff_round
        if parting is not None and source.localize is not None:
            local = source.localize(p, prompt, against, parting)
            explained = row.get("explained_by", []) + local.row.get("explained_by", [])
            row.update(local.row)
            if explained:
                row["explained_by"] = explained
            if prediction is not None:  # its rounds are those parting from the prediction, which its words say
                local.findings = [replace(f, localized={**f.localized, "at": PARTING_FROM_PREDICTION})
                                  if "at" not in f.localized else f for f in local.findings]
            findings += local.findings
        rows.append(row)
    identical = None if greedy is None else all(r["greedy_identical"] for r in rows)
    # Each side's positions up to the most it drafted (each drafted by some round: known), to 4 decimals as reported.
    sides = [("served", served_all, served_k), ("audited", audited_all, audited_k)]
    if prediction is not None:
        sides.append(("predicted", predicted_all, predicted_k))
    rates = {side: [round(rate, 4) for rate in per_position(lengths, drafted)] for side, lengths, drafted in sides}
    return Assessment(rows, rates, merge(findings), identical)

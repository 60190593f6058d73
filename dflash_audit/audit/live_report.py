"""A live section in the serving report (`serving.<engine>.live`), whichever engine ran it: its localization findings
(`Finding` records, from `dflash_audit/rounds/`) turned into the engine's own serving findings (`live:<what>`) and
joined to its static check's, on the engine's `EngineReport` record. Nothing is serialized here: the report writes
the records once (`EngineReport.to_dict`, `catalogue.findings.serialized`).
"""

from __future__ import annotations

from typing import Any

from catalogue.findings import Finding
from dflash_audit.tau.along_context import DEFAULT_BIN_TOKENS, ContextMarks, tau_along_context
from dflash_audit.tau.along_context import PromptRounds as AlongRounds
from serving_engines.verdict import EngineReport

ENGINE_NAMES = {"vllm": "vLLM", "llamacpp": "llama.cpp"}
# A localization's severity as a serving finding, by its kind: only what changes what the engine serves diverges.
LIVE_SEVERITY = {"quantization": "info", "tie": "info", "convention": "info", "input": "divergence",
                 "reading": "divergence",
                 "module": "divergence", "unlocalized": "divergence"}


def along_context(rows: list[dict[str, Any]], marks: ContextMarks | None = None,
                  bin_tokens: int = DEFAULT_BIN_TOKENS,
                  agreement: dict[str, list[bool]] | None = None) -> dict[str, dict[str, Any]]:
    """τ along the context of a live section's rows (`rounds.assess`'s), whichever engine ran them: the audit's
    replay (`audited`, the target's own greedy agreement on each prompt beside it where given) and the engine's rounds
    (`served`), each round at its anchor (the row's `prompt_tokens` + the tokens of its earlier rounds), in
    `bin_tokens`-wide bins, the drafter's `marks` on both."""
    agreement = agreement or {}
    return {side: tau_along_context([AlongRounds(id=row["id"], prompt_len=row["prompt_tokens"],
                                                 rounds=row[f"{side}_rounds"],
                                                 target_agreement=agreement.get(row["id"]) if side == "audited"
                                                 else None) for row in rows], marks, bin_tokens).to_dict()
            for side in ("audited", "served")}


FIRST_DIFFERING = "first differing round of"


def place_words(place: dict[str, Any]) -> str:
    """Where a localization's rounds are, in words true to them: each prompt's first round the engine and the audit
    part at, unless the finding says its rounds are others (`at`); nothing when it names no round (a finding whose
    own message says where, or that no round differs)."""
    pairs = [f"{p} round {r}" if r is not None else str(p)
             for p, r in zip(place.get("prompts", []), place.get("rounds", []), strict=True)]
    return f" ({place.get('at', FIRST_DIFFERING)} {', '.join(pairs)})" if pairs else ""


def live_findings(live: dict[str, Any]) -> list[Finding]:
    """The live section's findings as the engine's own serving findings (`live:<what>`)."""
    found = []
    if live.get("ran") and live.get("greedy_identical") is False:
        differing = [p["id"] for p in live["prompts"] if p["greedy_identical"] is False]
        found.append(Finding.serving("live:greedy_output", "divergence", "identical",
                                     f"{len(differing)} prompt(s) differ", "",
                                     f"speculation changed {ENGINE_NAMES.get(live.get('engine'), 'vLLM')}'s greedy "
                                     f"output on prompt(s) {', '.join(differing)}: it must never change it"))
    if live.get("ran") and live.get("sampled"):  # T > 0: the section's verdicts (`live_sampled`)
        found += sampled_findings(live)
    for f in live.get("findings", []):
        found.append(Finding.serving(f"live:{f.key}", LIVE_SEVERITY.get(f.kind, "divergence"), None, f.served,
                                     f.source, f"{f.kind}: {f.message}{place_words(f.localized)}"))
    if not live.get("ran") and live.get("refused"):
        found.append(Finding.serving("live:not_run", "warning", None, None, "", live["refused"]))
    return found


def sampled_findings(live: dict[str, Any]) -> list[Finding]:
    """A live run at T > 0 (`live_sampled.sampled_section`): the engine sampling at other temperatures than the
    request's (its probe, cited at the engine's site), and a served τ outside the interval predicted for it (the
    engine runs the drafter otherwise than the audit predicts: sampled rounds have no round to localize it at)."""
    found = []
    check, prediction = live.get("temperature_expansion") or {}, live.get("prediction") or {}
    if check.get("as_expected") is False:
        found.append(Finding.serving("live:rejection_sampler.temperature", "divergence", check["expected"],
                                     check["expanded"], check.get("source", ""), check["message"]))
    if prediction.get("served_as_predicted") is False:
        found.append(Finding.serving("live:sampled_tau", "divergence", prediction["predicted_tau"]["tau"],
                                     prediction["served_tau"]["tau"], "",
                                     f"at temperature {prediction['temperature']:g}, {prediction['verdict']}: the "
                                     "engine runs the drafter otherwise than the audit predicts; sampled rounds are "
                                     "not localized round by round"))
    return found


def attach(section: dict[str, EngineReport], engine: str, live: dict[str, Any]) -> None:
    """Put `live` on the engine's report, its findings joined to the static check's. A checkpoint the engine could
    not read but served from its conversion is a step the report names, no longer a `loads` divergence."""
    report = section[engine]
    report.live = live
    if live.get("ran") and live.get("notes"):
        for f in report.findings:
            if f.key == "loads" and "convert" in f.message:
                f.severity = "info"
                f.message = f"served from its conversion (a step, not a defect): {f.message}"
    report.findings = list(report.findings) + live_findings(live)

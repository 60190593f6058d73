"""`--live`: the served rounds (serving_engines.live) attached to a serve-check section as `vllm.live`, its
findings joined to the engine's own (severity divergence: each one changes what the engine serves)."""

from __future__ import annotations

from typing import Any

LIVE_SEVERITY = {"input": "divergence", "module": "divergence", "unlocalized": "divergence"}


def live_findings(live: dict[str, Any]) -> list[dict[str, Any]]:
    found = []
    if live.get("ran") and live.get("greedy_identical") is False:
        differing = [p["id"] for p in live["prompts"] if p["greedy_identical"] is False]
        found.append({"field": "live:greedy_output", "severity": "divergence", "trained": "identical",
                      "served": f"{len(differing)} prompt(s) differ", "source": "", "component": "serving",
                      "pitfall": None, "message": f"speculation changed vLLM's greedy output on prompt(s) "
                                                  f"{', '.join(differing)}: it must never change it"})
    for f in live.get("findings", []):
        rounds = ", ".join(f"{p} round {r}" for p, r in zip(f["prompts"], f["rounds"], strict=True))
        found.append({"field": f"live:{f['what']}", "severity": LIVE_SEVERITY.get(f["kind"], "divergence"),
                      "trained": None, "served": f["size"], "source": f["source"], "component": "serving",
                      "pitfall": None, "message": f"{f['kind']}: {f['message']} (first differing round of {rounds})"})
    if not live.get("ran") and live.get("refused"):
        found.append({"field": "live:not_run", "severity": "warning", "trained": None, "served": None, "source": "",
                      "component": "serving", "pitfall": None, "message": live["refused"]})
    return found


def attach_live(section: dict[str, Any], live: dict[str, Any]) -> None:
    """Put `live` under section["vllm"]["live"]; a checkpoint vLLM could not read but served from its conversion
    is a step the report names, no longer a `loads` divergence."""
    engine = section.setdefault("vllm", {"engine": "vllm", "findings": [], "notes": []})
    engine["live"] = live
    if live.get("ran") and live.get("notes"):
        for f in engine.get("findings", []):
            if f["field"] == "loads" and "convert" in f["message"]:
                f["severity"] = "info"
                f["message"] = f"served from its conversion (a step, not a defect): {f['message']}"
    engine["findings"] = list(engine.get("findings", [])) + live_findings(live)

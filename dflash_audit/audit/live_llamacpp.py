"""`serve-check --engine llamacpp --live [--quant TYPE]`: the drafter's GGUF served by a real llama-server (b11434),
every served round held to the audit's replay of the drafter as trained; the section is `serving.llamacpp.live`,
in the shape of vLLM's (`live_check.py`).

The engine runs the target alone (the greedy reference) and then with the drafter, on the audit's token ids, greedy.
A served round comes from the engine's own trace line (`accepted X/ Y draft tokens`): X + 1 tokens. llama.cpp has no
Python to hook, so a prompt whose rounds differ is localized by counterfactual replays in the audit, each changing
one thing to what the engine has: the GGUF's dequantized weights, the block the engine drafted, the target layers
the GGUF declares, its mask token. The first variant whose rounds equal the engine's through the first round where
the engine and the audit part names the finding; a difference no variant reproduces stays `unlocalized`, with its
first differing round.
"""

from __future__ import annotations

import contextlib
import re
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from catalogue.findings import Finding
from foundation.errors import AuditError
from serving_engines.live.host import merge

# The counterfactual replays, in the order they are tried, and the rule that each one names.
VARIANTS = (
    ("quantization", None, "the GGUF's own (dequantized) weights"),
    ("block_length", "block_size", "the block the engine drafted (1 + --spec-draft-n-max, clamped to the GGUF's "
                                   "dflash.block_size - 1)"),
    ("target_layer_ids", "target_layer_ids", "the target layers the GGUF declares (dflash.target_layers - 1)"),
    ("mask_token_id", "mask_token_id", "the GGUF's mask token (tokenizer.ggml.mask_token_id)"),
    ("layer_causal", "layer_causal", "every draft layer non-causal, as the engine runs a GGUF without "
                                     "dflash.attention.causal = true"),
    ("final_block", "final_block", "the whole block drafted in every round, its proposals cut to what is left, as "
                                   "the engine drafts near the budget's end (z-lab shrinks the block there)"),
)
# A variant that is the engine's own convention, not a defect of how it serves the drafter.
CONVENTIONS = ("final_block",)


@dataclass
class Served:
    """The GGUF the engine serves, as trained (the source's spec and weights) and as written (the GGUF's)."""

    gguf: Path
    spec: Any  # trained
    state: dict[str, torch.Tensor]  # trained
    gguf_spec: Any  # the GGUF's, read back
    gguf_state: dict[str, torch.Tensor]
    quantized: dict[str, str]
    notes: list[str]
    causal: bool = False  # the GGUF's dflash.attention.causal (absent: false, as llama.cpp reads it)


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
                  bool(written.gguf["metadata"].get("dflash.attention.causal", False)))


def replay(spec, state, target_model, prompts, max_new_tokens, stop_ids, whole_blocks: bool = False) -> list:
    from impl.body_shapes import build_drafter
    from impl.decoding import dflash_decode

    model = build_drafter(spec, state, dtype=target_model.dtype).eval()
    return [dflash_decode(model, target_model, torch.tensor([p["ids"]]), max_new_tokens, stop_ids,
                          whole_blocks=whole_blocks) for p in prompts]


def variant_of(name: str, served: Served, block: int):
    """(spec, state) of the counterfactual `name`: the trained drafter with one thing as the engine has it."""
    spec, state = served.spec, served.state
    if name == "quantization":
        return spec, {k: served.gguf_state.get(k, v) for k, v in state.items()}
    if name == "block_length":
        return spec.replace(block_size=block), state
    if name == "target_layer_ids":
        return spec.replace(target_layer_ids=served.gguf_spec.target_layer_ids), state
    if name == "layer_causal":
        return spec.replace(sliding_window_non_causal=True), state
    if name == "final_block":  # the decode differs (replay's whole_blocks), not the drafter
        return spec, state
    return spec.replace(mask_token_id=served.gguf_spec.mask_token_id), state


def differs(name: str, served: Served, block: int) -> bool:
    """Whether the engine's side differs from training in what `name` changes (else replaying it proves nothing)."""
    if name == "quantization":
        return any(not torch.equal(served.gguf_state[k], v.to(served.gguf_state[k].dtype))
                   for k, v in served.state.items() if k in served.gguf_state)
    if name == "block_length":
        return block != served.spec.block_size
    if name == "layer_causal":
        return not served.causal and any(served.spec.block_is_causal(i) for i in range(served.spec.num_hidden_layers))
    if name == "final_block":
        return True  # the engine never shrinks its block: only a prompt's last rounds can show it
    field = {"target_layer_ids": "target_layer_ids", "mask_token_id": "mask_token_id"}[name]
    return getattr(served.gguf_spec, field) != getattr(served.spec, field)


# Two float32 implementations of the same drafter (ggml's CPU kernels, torch's) sum in other orders: their logits part
# by about 1e-4 here, so two candidates closer than this may come out in either order. A flip is only ever taken
# where it is this close, and only kept when the replay taking it then gives the engine's rounds.
TIE_MARGIN = 1e-3


class TieFlips:
    """The drafter's top-two logit margin recorded at every slot of every round (one `compute_logits` per round,
    for a DFlash drafter without a selector), and chosen slots' top two swapped, as the engine's argmax had them."""

    def __init__(self, model, flips: dict[int, set[int]]):
        self.flips, self.round, self.margins, self.tops = flips, 0, [], []
        plain = model.compute_logits

        def compute_logits(hidden, head):
            logits = plain(hidden, head)
            top = logits.float().topk(2, dim=-1)
            self.margins.append((top.values[:, 0] - top.values[:, 1]).tolist())
            self.tops.append(top.indices.tolist())
            for slot in self.flips.get(self.round, ()):
                first, second = top.indices[slot].tolist()
                logits = logits.clone()
                kept = logits[slot, first].item()
                logits[slot, first] = logits[slot, second]
                logits[slot, second] = kept
            self.round += 1
            return logits

        model.compute_logits = compute_logits  # this replay's drafter only: built for it


def tie_flips(served: Served, target_model, prompt: dict, max_new_tokens: int, stop_ids, s_rounds: list[int],
              max_flips: int = 8) -> tuple[list[dict], int | None] | None:
    """Whether the engine's rounds are the replay's (the GGUF's own weights) with argmax near-ties broken the other
    way: at each differing round, the first slot where the engine's and the replay's proposals part must be a
    near-tie (top two within TIE_MARGIN), and the replay taking the runner-up there must give the engine's round.
    (ties taken, the first round still differing after them or None), or None when the first is no tie."""
    from impl.body_shapes import build_drafter
    from impl.decoding import dflash_decode

    spec, state = variant_of("quantization", served, served.spec.block_size)
    flips: dict[int, set[int]] = {}
    taken: list[dict] = []
    for _ in range(max_flips + 1):
        model = build_drafter(spec, state, dtype=target_model.dtype).eval()
        if model.candidate_selector is not None or model.reads_whole_block:
            return None  # its proposals are not each slot's own argmax
        record = TieFlips(model, flips)
        rounds = dflash_decode(model, target_model, torch.tensor([prompt["ids"]]), max_new_tokens, stop_ids,
                               whole_blocks=True).acceptance_lengths  # drafted as the engine drafts
        first = first_difference(s_rounds, rounds)
        if first is None:
            return taken, None
        index = first - 1
        slot = min(s_rounds[index:index + 1] + rounds[index:index + 1]) - 1  # the first proposal they judge apart
        margins = record.margins[index] if index < len(record.margins) else []
        if slot >= len(margins) or margins[slot] >= TIE_MARGIN or slot in flips.get(index, set()) \
                or len(taken) == max_flips:
            return (taken, first) if taken else None
        flips.setdefault(index, set()).add(slot)
        replay_top, runner_up = record.tops[index][slot]
        taken.append({"round": first, "slot": slot + 1, "margin": round(margins[slot], 6), "replay_token": replay_top,
                      "engine_token": runner_up})
    return None


def abort_source() -> str:
    from serving_engines.llamacpp_engine import RULES, cite

    graph = next(rule for rule in RULES if rule.path == "src/llama-graph.cpp")
    return cite(graph.path, graph.needle)


def first_difference(served_rounds: list[int], audited_rounds: list[int]) -> int | None:
    for i in range(max(len(served_rounds), len(audited_rounds))):
        if i >= len(served_rounds) or i >= len(audited_rounds) or served_rounds[i] != audited_rounds[i]:
            return i + 1
    return None


def per_position(rounds: list[int], k: int) -> list[float]:
    return [round(sum(r - 1 > j for r in rounds) / len(rounds), 4) if rounds else 0.0 for j in range(k)]


def run_and_assess(engine, target_gguf: Path, served: Served, target_model, prompts, max_new_tokens, stop_ids,
                   greedy: list[list[int]], audited: list, workdir: Path, label: str, n_max: int,
                   kv_type: str | None = None) -> dict:
    """One llama-server with the drafter; its rounds against the audit's, each differing prompt localized."""
    from serving_engines.live.llamacpp_server import LlamaServer, served_rounds
    from serving_engines.llamacpp_engine import source

    gguf_block = served.gguf_spec.block_size
    block = 1 + min(n_max, gguf_block - 1)
    rows, findings, served_all, audited_all = [], [], [], []
    started = time.monotonic()
    try:
        with LlamaServer(engine, target_gguf, workdir / f"{label}.log", served.gguf, n_max, kv_type) as server:
            results = [server.complete(p["ids"], max_new_tokens) for p in prompts]
        peak = server.peak_rss_mb
    except AuditError as exc:
        if "layer input tensor is null" in str(exc):
            capture = Finding.localization(
                "input", "target_layer_capture", "llama-server aborts on the first request: the drafter reads the "
                "target's last layer, whose output the Qwen3 graph never records (it records each layer's input)",
                None, abort_source(), prompts[0]["id"], 1)
            return {"ran": False, "refused": str(exc), "findings": [f.to_dict() for f in merge([capture])],
                    "prompts": [], "greedy_identical": None, "per_position": {"served": [], "audited": []}}
        raise
    wall = time.monotonic() - started
    variant_runs: dict[str, list] = {}
    for p, (prompt, result, run) in enumerate(zip(prompts, results, audited, strict=True)):
        output = result["tokens"]
        s_rounds = served_rounds(result["accepted"], len(output))
        a_rounds = run.acceptance_lengths
        first = first_difference(s_rounds, a_rounds)
        served_all += s_rounds
        audited_all += a_rounds
        row = {"id": prompt["id"], "served_tau": round(len(output) / max(1, len(s_rounds) + 1), 4) if output else 0.0,
               "audited_tau": round(run.tau, 4), "rounds": max(len(s_rounds), len(a_rounds)),
               "rounds_equal": sum(a == b for a, b in zip(s_rounds, a_rounds)), "first_diff_round": first,
               "greedy_identical": output == greedy[p], "draft_n": result["timings"].get("draft_n"),
               "draft_n_accepted": result["timings"].get("draft_n_accepted"), "served_rounds": s_rounds,
               "audited_rounds": a_rounds}
        row["served_tau"] = round(sum(s_rounds) / len(s_rounds), 4) if s_rounds else 0.0
        if first is not None:
            explained = None
            for name, rule, words in VARIANTS:
                if not differs(name, served, block):
                    continue
                if name not in variant_runs:
                    variant_runs[name] = replay(*variant_of(name, served, block), target_model, prompts,
                                                max_new_tokens, stop_ids, whole_blocks=name == "final_block")
                replayed = variant_runs[name][p].acceptance_lengths
                # It reproduces the engine through the first round the audit and the engine part at (a quantized
                # kernel's rounding may part them again later: those rounds are downstream, counted in the row).
                if replayed[:first] == s_rounds[:first]:
                    explained = (name, rule, words)
                    row["variant_rounds_equal"] = replayed == s_rounds
                    break
            ties = tie_flips(served, target_model, prompt, max_new_tokens, stop_ids, s_rounds) \
                if explained is None else None
            if ties is not None and not ties[0]:
                # No flip needed: the GGUF's own weights drafting whole blocks as the engine does give its rounds,
                # where neither alone did (a quantized drafter's last block): both named, at the round they part.
                name, rule, words = next(v for v in VARIANTS if v[0] == "final_block")
                row["explained_by"] = ["quantization"] * differs("quantization", served, block) + [name]
                findings.append(Finding.localization(
                    "convention", name, f"the audit's replay with the GGUF's own (dequantized) weights and {words} "
                    f"gives the engine's rounds (neither alone does)", None, source(rule), prompt["id"], first))
            elif ties is not None:
                taken, still = ties
                row["ties"], row["explained_by"] = taken, ["argmax_tie"]
                findings.append(Finding.localization(
                    "tie", "argmax_tie", f"the drafter's top two logits at the slot where the engine and the audit "
                    f"part are within {TIE_MARGIN:g} of each other (an argmax near-tie that float32 kernels summing in "
                    f"another order break the other way); the audit's replay taking the runner-up there gives the "
                    f"engine's rounds", taken[0]["margin"], source("argmax_tie"), prompt["id"], first))
                if still is not None:  # a later round no tie explains is still a difference
                    findings.append(Finding.localization(
                        "unlocalized", "rounds", "after the argmax near-ties, no counterfactual replay reproduces the "
                        "engine's rounds", None, source("rounds"), prompt["id"], still))
            elif explained is None:
                findings.append(Finding.localization(
                    "unlocalized", "rounds", "no counterfactual replay (" + ", ".join(
                        words for _, _, words in VARIANTS) + ") reproduces the engine's rounds", None,
                    source("rounds"), prompt["id"], first))
            else:
                name, rule, words = explained
                types = ", ".join(sorted(set(served.quantized.values())))
                findings.append(Finding.localization(
                    "convention" if name in CONVENTIONS else "input", name,
                    f"the audit's replay with {words} gives the engine's rounds", None,
                    source(rule) if rule else f"the GGUF's tensor types ({types})", prompt["id"], first))
                row["explained_by"] = [name]
        rows.append(row)
    k = block - 1
    return {"ran": True, "prompts": rows, "greedy_identical": all(r["greedy_identical"] for r in rows),
            "per_position": {"served": per_position(served_all, k), "audited": per_position(audited_all, k)},
            "findings": [f.to_dict() for f in merge(findings)], "generate_s": round(wall, 2), "block_size": block,
            "engine_peak_rss_mb": round(peak) if peak is not None else None}


def quantization_finding(served: Served, rows: list[dict], target_model, prompts, max_new_tokens, stop_ids,
                         quant: str) -> dict:
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
    message = (f"served {quant} ({types}) costs {mean:.4f} τ per prompt on average against the drafter as trained; "
               f"the audit's replay with the dequantized GGUF weights "
               f"{'gives the served τ on every prompt' if confirmed else 'differs from the served τ on some prompt'}")
    found = Finding.localization("quantization", "quantization", message, round(mean, 4),
                                 f"llama-quantize / the GGUF's tensor types ({types})", "", 0)
    # Every prompt's cost, not one place: the τ it costs is the finding's evidence.
    found = replace(found, severity="info", localized={"kind": "quantization", "per_prompt": per_prompt,
                                                       "prompts": [p["id"] for p in per_prompt],
                                                       "rounds": [0] * len(per_prompt)})
    return found.to_dict()


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
                     log: Path) -> tuple[list[list[int]], dict[int, str]]:
    """(the target alone's greedy output per prompt, the server's end-of-generation set)."""
    from serving_engines.live.llamacpp_server import LlamaServer

    stat = target_file.stat()
    key = (engine.server, str(target_file.resolve()), stat.st_size, stat.st_mtime_ns, max_new_tokens,
           tuple(tuple(p["ids"]) for p in prompts))
    if key not in GREEDY:
        with LlamaServer(engine, target_file, log, log_vocabulary=True) as server:
            outputs = [server.complete(p["ids"], max_new_tokens)["tokens"] for p in prompts]
        GREEDY[key] = outputs, engine_stop_ids(log.read_text(errors="replace"))
    outputs, eog = GREEDY[key]
    return [list(tokens) for tokens in outputs], dict(eog)


def stop_source() -> str:
    from serving_engines.llamacpp_engine import RULES, cite

    return "; ".join(cite(rule.path, rule.needle) for rule in RULES if rule.field == "stop_ids")


def round_of(position: int, rounds: list[int]) -> int:
    """The served round that produced output position `position` (0: the prefill's token)."""
    total = 0
    for number, size in enumerate(rounds, 1):
        total += size
        if total >= position:
            return number
    return len(rounds)


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
                prompt["id"], round_of(position, rounds.get(prompt["id"], []))))
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
                  workdir: Path | None = None) -> dict:
    """The `serving.llamacpp.live` section. `plants`: label -> {gguf: a GGUF to serve instead, n_max: ...}: each
    planted run is assessed like the served one (section["planted"][label])."""
    from serving_engines.live.llamacpp_env import find_llamacpp

    engine = find_llamacpp(bin_dir)
    with workspace(workdir) as folder:
        return run_live(engine, Path(drafter), Path(target), prompts_path, max_new_tokens, quant, bin_dir, n_max,
                        kv_type, plants or {}, folder)


def run_live(engine, drafter: Path, target: Path, prompts_path, max_new_tokens, quant, bin_dir, n_max, kv_type,
             plants: dict[str, dict], workdir: Path) -> dict:
    from dflash_audit.audit.live_check import load_prompts_for
    from foundation.target import load_target
    from foundation.target_vocab import stop_token_ids
    from serving_engines.live.llamacpp_convert import target_gguf

    served = prepare(Path(drafter), Path(target), workdir, quant, bin_dir)
    target_file, _ = target_gguf(Path(target))
    target_model, tokenizer = load_target(target)
    prompts = load_prompts_for(Path(target), prompts_path, tokenizer)
    stops = stop_token_ids(target, tokenizer)  # z-lab's; the engine cannot be told them
    started = time.monotonic()
    greedy, eog = greedy_reference(engine, target_file, prompts, max_new_tokens, workdir / "greedy.log")
    stop_ids = sorted(eog) if eog else stops.ids  # the replay stops where the engine stops
    audited = replay(served.spec, served.state, target_model, prompts, max_new_tokens, stop_ids)
    chosen = n_max if n_max is not None else served.spec.block_size - 1
    from serving_engines.llamacpp_engine import command

    section = {"engine": "llamacpp", "version": engine.version, "python": engine.bin_dir,
               "command": command(str(target_file), str(served.gguf), chosen, False, kv_type),
               "served_path": str(served.gguf), "notes": served.notes, "max_new_tokens": max_new_tokens,
               **stops.report(),
               "engine_stop_ids": {"ids": sorted(eog), "tokens": {str(i): eog[i] for i in sorted(eog)},
                                   "source": stop_source() if eog else "none in the server's log"},
               "replay_stop_ids": stop_ids, "quant": quant, "quantized_tensors": served.quantized}
    if not eog:
        section["notes"].append("llama-server's log names no end-of-generation token: where it stops is unknown; the "
                                "audit's replay stops at z-lab's stop ids")
    section.update(run_and_assess(engine, target_file, served, target_model, prompts, max_new_tokens, stop_ids, greedy,
                                  audited, workdir, "served", chosen, kv_type))
    if section.get("ran") and eog:
        differ, notes = stop_difference(eog, stops, prompts, greedy, section["prompts"])
        section["findings"] += [f.to_dict() for f in differ]
        section["notes"] += notes
    if quant is not None and section.get("ran"):
        section["findings"].append(quantization_finding(served, section["prompts"], target_model, prompts,
                                                        max_new_tokens, stop_ids, quant))
    for label, plant in plants.items():
        planted = Served(Path(plant.get("gguf", served.gguf)), served.spec, served.state, served.gguf_spec,
                         served.gguf_state, served.quantized, [], served.causal)
        if "gguf" in plant:
            from dflash_audit.formats import LoadOptions, load_any

            written = load_any(planted.gguf, target_dir=target, options=LoadOptions(flag_prefix=""))
            planted.gguf_spec, planted.gguf_state = written.spec, written.state_dict
        count = plant.get("prompts", len(prompts))
        section.setdefault("planted", {})[label] = run_and_assess(
            engine, target_file, planted, target_model, prompts[:count], max_new_tokens, stop_ids, greedy[:count],
            audited[:count], workdir, label, plant.get("n_max", chosen))
    section["engine_wall_s"] = round(time.monotonic() - started, 1)
    return section


def attach_llamacpp_live(section: dict[str, Any], live: dict[str, Any]) -> None:
    """Put `live` under section["llamacpp"]["live"], its findings joined to the static check's."""
    from dflash_audit.audit.live_check import live_findings

    engine = section.setdefault("llamacpp", {"engine": "llamacpp", "findings": [], "notes": []})
    engine["live"] = live
    engine["findings"] = list(engine.get("findings", [])) + [f.to_dict() for f in live_findings(live)]

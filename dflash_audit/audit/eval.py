"""What `dflash-audit eval` runs: per-prompt τ and per-round acceptance lengths of one drafter (`run_eval`), or
the τ table over benchmark prompt sets (`run_table`: τ per set × τ method × decoding × temperature × chat setting).

`run_eval`'s `mode="live"` runs speculative decoding (DFlash or DDTree) against the target; `mode="offline"` replays
the same walks from a hidden-state cache built once per (target, prompts, settings) under `cache_dir`. Under
`torchrun` the prompts are sharded across ranks (gloo) and rank 0 gathers, prints and writes the results.
`run_table` runs when eval is given `--table`, `--tau-method`, `--tau-by`, a `NAME:PATH` prompt set,
`--max-samples`, or more than one set, method, temperature or budget (`uses_table`); it prints the table, writes
`--json` and `--html`. Both read the drafter through the one fit check (`audit/drafter_fit.py`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console
from tabulate import tabulate

from dflash_audit.outputs import check_cache_dir, check_not_foreign, check_outputs, check_writable
from dflash_audit.progress import progress
from dflash_audit.prompts import fit_prompts, load_prompts, tokenize_prompt, tokenize_prompts
from dflash_audit.ranks import Ranks
from dflash_audit.tau.declared import declared_settings, template_findings
from dflash_audit.tau.along_context import (AlongContext, PromptRounds, context_marks, greedy_agreement, side_by_side,
                                            tau_along_context)
from dflash_audit.tau.grid import Decoding, run_grid
from dflash_audit.tau.published import resolve_published
from dflash_audit.tau.table_out import cell_label, payload, terminal_table, write_html, write_json
from foundation.atomic import atomic_write_bytes
from foundation.benchmarks.sets import BenchmarkPrompt, PromptSet, parse_prompts_flag, read_prompt_set, select
from foundation.cache_dir import cache_root
from foundation.chat_template import ChatTemplate, thinking_settings
from foundation.errors import AuditError
from foundation.placement import resolve_placement
from foundation.target_vocab import TargetVocabulary, mask_token_problems, stop_token_ids

if TYPE_CHECKING:
    from dflash_audit.flags.eval import EvalFlags


def mask_token_notes(mask_token_id: int, target: TargetVocabulary) -> list[str]:
    """τ is still measured, but a mask id the target uses for something else is said (PITFALLS #34)."""
    limits = {"vocabulary": target.config_vocab_size, "embedding": target.embedding_rows}
    return [f"the drafter's mask token {mask_token_id} is {phrase} (PITFALLS #34; `compare --target` reports it as "
            "a mask_token_validity divergence)" for _, phrase in mask_token_problems(mask_token_id, limits,
                                                                                       target.special_ids)]


def check_json_output(json_path: Path | None, inputs: dict[str, Path], force: bool = False) -> None:
    """--json is no input, replaces no file the tool did not write (unless --force), and is writable,
    before any model loads."""
    if json_path is not None:
        check_outputs({"--json": json_path}, inputs)
        check_writable("--json", json_path)
        check_not_foreign("--json", json_path, force)


def evaluate_prompts(drafter, target, prompts, method: str, budget: int, max_new_tokens: int, temperature: float,
                     seed: int, stop_ids: list[int], advance) -> list[dict]:
    """Live: decode `prompts`, one by one."""
    from impl.ddtree import ddtree_decode
    from impl.decoding import dflash_decode

    results = []
    for prompt_id, ids in prompts:
        if method == "dflash":
            run = dflash_decode(drafter, target, ids, max_new_tokens, stop_ids, temperature, seed)
        else:
            run = ddtree_decode(drafter, target, ids, max_new_tokens, stop_ids, budget)
        results.append({"id": prompt_id, "tau": run.tau, "rounds": run.acceptance_lengths})
        advance(len(run.new_tokens))
    return results


def replay_prompts(drafter, target, target_dir: Path, prompts, method: str, budget: int, max_new_tokens: int,
                   stop_ids: list[int], cache_dir: Path | None, ranks: Ranks, bar) -> list[dict]:
    """Offline: every prompt's rounds replayed from the hidden-state cache (the runner compare's τ uses too)."""
    from dflash_audit.offline_tau import replay_offline
    from impl.acceptance import mean_acceptance

    run = replay_offline({"drafter": drafter}, target, target_dir, prompts, max_new_tokens, stop_ids,
                         [(method, budget if method == "ddtree" else None)], cache_root(cache_dir) / "offline", ranks,
                         bar)
    return [{"id": entry.id, "tau": mean_acceptance(rounds), "rounds": rounds}
            for i, entry in enumerate(run.cache.prompts) for rounds in [run.rounds[method, "drafter", i]]]


def along_context_of(results: list[dict], prompts, target, marks, bin_tokens: int) -> AlongContext:
    """τ along the context of eval's per-prompt rounds in `bin_tokens`-wide bins, the target's greedy agreement on
    each prompt beside it."""
    ids = dict(prompts)
    return tau_along_context([PromptRounds(id=r["id"], prompt_len=ids[r["id"]].shape[1], rounds=r["rounds"],
                                           target_agreement=greedy_agreement(target, ids[r["id"]]))
                              for r in results], marks, bin_tokens)


def run_eval(flags: EvalFlags, console: Console | None = None, memory: dict | None = None) -> dict | None:
    """One prompts file's τ as `eval`'s validated flags ask: evaluate, print the table and write `--json` (rank
    0); returns the JSON payload there.

    `memory`: free memory handed to the memory plan (`free_on_devices`, `free_on_host`) instead of
    the machine's own, for tests."""
    drafter_path, target_dir, prompts_path = flags.drafter, flags.target, Path(flags.prompts[0])
    method, budget, mode, max_new_tokens = flags.method[0], flags.budget[0], flags.mode, flags.max_new_tokens
    temperature, seed, json_path, cache_dir = flags.temperature[0], flags.seed, flags.json_path, flags.cache_dir
    inputs = {"--drafter": drafter_path, "--target": target_dir, "--prompts": prompts_path}
    check_json_output(json_path, inputs, flags.force)
    check_cache_dir(cache_dir, inputs)
    placement = resolve_placement(flags.device, flags.dtype, flags.device_map, target_dir)
    console = console or Console(stderr=True)
    records = load_prompts(prompts_path)  # bad input fails before any model loads
    from dflash_audit.audit.drafter_fit import place_drafter, read_loaded_drafter
    from foundation.target import load_target_model, load_tokenizer
    from impl.body_shapes import build_drafter
    from impl.ddtree import require_dflash_family
    from impl.acceptance import acceptance_histogram, mean_acceptance
    from impl.memory_plan import check_plan, plan_memory

    chat = ChatTemplate.parse(flags.chat_template, flags.chat_template_kwargs)
    tokenizer, config = load_tokenizer(target_dir)
    chat.check_kwargs(tokenizer)
    loaded, spec = read_loaded_drafter(drafter_path, target_dir, config, flags.load_options)
    state_dict = loaded.state_dict
    if method == "ddtree" and spec.family != "dflash":
        require_dflash_family(build_drafter(spec, state_dict))  # before any prompt is decoded or cached
    prompts, notes = fit_prompts(tokenize_prompts(tokenizer, records, chat), max_new_tokens,
                                 config.max_position_embeddings, flags.truncate, str(prompts_path))
    notes += mask_token_notes(spec.mask_token_id, TargetVocabulary.read(target_dir, tokenizer))
    # Before any target weight is read: does it all fit?
    check_plan(plan_memory(config, placement.dtype, [spec], [ids.shape[1] for _, ids in prompts], max_new_tokens),
               placement, **(memory or {}))
    target = load_target_model(target_dir, placement)
    drafter = place_drafter(spec, state_dict, drafter_path, target)
    for note in notes:
        console.print(f"note: {note}", soft_wrap=True)
    stops = stop_token_ids(target_dir, tokenizer)
    stop_ids = stops.ids
    ranks = Ranks()
    order = {prompt_id: i for i, (prompt_id, _) in enumerate(prompts)}
    mine = ranks.shard(prompts)
    with progress(console, f"eval {method} ({mode})", len(mine), max_new_tokens, enabled=ranks.rank == 0) as bar:
        if mode == "offline":  # one cache for all prompts, built by rank 0; every rank replays its share
            results = replay_prompts(drafter, target, target_dir, prompts, method, budget, max_new_tokens, stop_ids,
                                     cache_dir, ranks, bar)
        else:
            results = ranks.gather(evaluate_prompts(drafter, target, mine, method, budget, max_new_tokens,
                                                    temperature, seed, stop_ids, advance=bar.advance))
    results = sorted(results, key=lambda r: order[r["id"]])
    ranks.close()
    if ranks.rank != 0:
        return None
    along = along_context_of(results, prompts, target, context_marks(spec, loaded.recipe, loaded.recipe_unknown),
                             flags.tau_bin_tokens)

    all_rounds = [length for r in results for length in r["rounds"]]
    longest = drafter.spec.longest_round
    payload = {"schema": "dflash-audit/eval/1", "method": method, "mode": mode, "budget": budget if method == "ddtree" else None,
               "max_new_tokens": max_new_tokens, **stops.report(), "placement": placement.describe(),
               "chat_template": chat.describe(tokenizer), "prompts": results,
               "mean_tau": mean_acceptance([r["tau"] for r in results]),
               "histogram": acceptance_histogram(all_rounds, longest), "along_context": along.to_dict()}
    rows = [[r["id"], len(r["rounds"]), sum(r["rounds"]) + 1, f"{r['tau']:.2f}"] for r in results]
    print(tabulate(rows, headers=["prompt", "rounds", "new tokens", "τ"], tablefmt="github"))
    print(f"mean τ ({method}, {mode}): {payload['mean_tau']:.3f}   acceptance histogram 0..{longest}: "
          f"{payload['histogram']}")
    print(along.table())
    where = placement.describe()
    print(f"target and drafter in {where['dtype']} ({where['dtype_source']}) on {where['device']}"
          + (f", target sharded by --device-map {placement.device_map}" if placement.device_map else ""))
    if json_path is not None:
        text = json.dumps(payload, indent=2)
        atomic_write_bytes(Path(json_path), lambda tmp: Path(tmp).write_text(text))
    return payload


def plain_prompt_set(path: str | Path, max_samples: int | None = None) -> PromptSet:
    """A plain prompts file (`{"id", "prompt"}` or `{"turns"}` lines), through the existing reader."""
    records = load_prompts(path)
    prompts = [BenchmarkPrompt(r["id"], [r["prompt"]], None) for r in records]
    chosen = prompts if max_samples is None else select(prompts, max_samples)
    return PromptSet("prompts", Path(path), chosen, "the 'prompt' field (or first of 'turns') as written",
                     rows=len(prompts), selection="all rows, file order" if max_samples is None else
                     f"{len(chosen)} of {len(prompts)} by z-lab's seeded selection (_select_dataset, seed 42)")


def prompt_set_from_flag(value: str, max_samples: int | None = None) -> PromptSet:
    """A `--prompts` value as a prompt set: a benchmark's own file (`NAME:PATH`) or a plain prompts file (`PATH`)."""
    name, path = parse_prompts_flag(value)
    return plain_prompt_set(path, max_samples) if name is None else read_prompt_set(name, path, max_samples)


def decodings_of(methods: list[str], budgets: list[int]) -> list[Decoding]:
    out = []
    for method in dict.fromkeys(methods):
        out += [Decoding("ddtree", b) for b in dict.fromkeys(budgets)] if method == "ddtree" else [Decoding("dflash")]
    return out


def check_table_outputs(flags: EvalFlags) -> None:
    outputs = {"--json": flags.json_path, "--html": flags.html_path}
    check_outputs(outputs, {"--drafter": flags.drafter, "--target": flags.target})
    for flag, path in outputs.items():
        if path is not None:
            check_writable(flag, path)
            check_not_foreign(flag, path, flags.force)  # a user's file is never replaced silently


def run_table(flags: EvalFlags, console: Console | None = None) -> dict:
    """The τ table as `eval`'s validated flags ask: every set × τ method × decoding × temperature × chat setting,
    printed, written to `--json` and `--html`."""
    from dflash_audit.audit.drafter_fit import place_drafter, read_loaded_drafter
    from foundation.target import load_target_model, load_tokenizer

    console = console or Console(stderr=True)
    drafter_path, target_dir, max_new_tokens = flags.drafter, flags.target, flags.max_new_tokens
    tau_methods, temperatures, tau_by = flags.tau_method or ["live"], flags.temperature, flags.tau_by
    json_path, html_path = flags.json_path, flags.html_path
    chat = ChatTemplate.parse(flags.chat_template, flags.chat_template_kwargs)
    check_table_outputs(flags)
    decodings = decodings_of(flags.method, flags.budget)
    # Bad input before any model.
    prompt_sets = [prompt_set_from_flag(value, flags.max_samples) for value in flags.prompts]
    placement = resolve_placement(flags.device, flags.dtype, flags.device_map, target_dir)
    published_target = resolve_published(flags.published, target_dir)
    tokenizer, config = load_tokenizer(target_dir)
    chat.check_kwargs(tokenizer)
    if "zlab-benchmark" in tau_methods and chat.template(tokenizer) is None:  # said before any model loads
        raise AuditError("--tau-method zlab-benchmark renders every prompt through a chat template: the target "
                         "tokenizer has none (give one with --chat-template FILE)")
    chats = {"default": chat} if tau_by is None else {f"thinking {k}": v
                                                      for k, v in thinking_settings(chat, tokenizer).items()}
    for prompt_set in prompt_sets:  # a first turn past the target's context, refused before any model loads
        for setting in chats.values():
            fit_prompts([(p.id, tokenize_prompt(tokenizer, p.prompt, setting)) for p in prompt_set.prompts],
                        max_new_tokens, config.max_position_embeddings, source=str(prompt_set.path),
                        truncatable=False)
    loaded, spec = read_loaded_drafter(drafter_path, target_dir, config, flags.load_options)
    state_dict = loaded.state_dict
    declared, where = declared_settings(loaded.raw.config, flags.trained_kwargs)
    findings = template_findings(declared, where, {label: c.kwargs for label, c in chats.items()})
    target = load_target_model(target_dir, placement)
    drafter = place_drafter(spec, state_dict, drafter_path, target)
    stops = stop_token_ids(target_dir, tokenizer)
    cells, skipped = run_grid(drafter, target, tokenizer, prompt_sets, tau_methods, decodings, temperatures, chats,
                              max_new_tokens, flags.seed_list, published_target, stops.ids,
                              advance=lambda: console.print(".", end=""))
    console.print()
    marks = context_marks(spec, loaded.recipe, loaded.recipe_unknown)
    alongs = {}
    for cell in cells:  # every response of every seed, at its prompt's length
        along = tau_along_context([PromptRounds(id=str(r["id"]), prompt_len=r["prompt_tokens"], rounds=r["rounds"])
                                   for run in cell["runs"] for r in run["prompts"]], marks, flags.tau_bin_tokens)
        cell["along_context"] = along.to_dict()
        alongs[f"{cell['set']} {cell_label(cell)}"] = along
    data = payload(cells, [s.describe() for s in prompt_sets],
                   {"drafter": str(drafter_path), "target": str(target_dir), "max_new_tokens": max_new_tokens,
                    **stops.report(), "published_target": published_target, "placement": placement.describe(),
                    "trained_chat_template": {"kwargs": declared, "declared_in": where} if declared else None,
                    "findings": [f.to_dict() for f in findings]}, skipped)
    for s in data["sets"]:
        print(f"{s['name']}: {s['count']} of {s['rows']} rows ({s['selection']}); rendering: {s['rendering']}")
    print(terminal_table(cells))
    print(side_by_side(alongs))
    for finding in findings:
        print(f"{finding.severity}  {finding.component}  {finding.message}")
    for note in skipped:
        print(f"not run: {note}")
    if json_path is not None:
        write_json(json_path, data)
    if html_path is not None:
        write_html(html_path, data)
    return data


def evaluate(flags: EvalFlags) -> None:
    """`eval` as its validated flags ask: the τ table when they ask for one (`uses_table`), else one prompts file's
    τ."""
    if flags.uses_table:
        run_table(flags)
    else:
        run_eval(flags)

"""`dflash-audit eval`: per-prompt τ and per-round acceptance lengths of one drafter.

`--mode live` runs speculative decoding (DFlash or DDTree) against the target;
`--mode offline` replays the same walks from a hidden-state cache built once per
(target, prompts, settings) under `--cache-dir`. Under `torchrun` the prompts are sharded
across ranks (gloo) and rank 0 gathers, prints and writes the results.
"""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.console import Console
from tabulate import tabulate

from dflash_audit.commands import VERBS
from dflash_audit.outputs import check_cache_dir, check_not_foreign, check_outputs, check_writable
from dflash_audit.progress import progress
from dflash_audit.prompts import (
    fit_prompts,
    load_prompts,
    tokenize_prompts,
)
from dflash_audit.ranks import Ranks
from foundation.atomic import atomic_write_bytes
from foundation.cache_dir import cache_root
from foundation.chat_template import CHAT_TEMPLATE_HELP, ChatTemplate
from foundation.errors import AuditError
from foundation.inputs import check_generation_flags
from foundation.placement import (
    CPU_FLOAT32,
    DEVICE_HELP,
    DEVICE_MAP_HELP,
    DTYPE_HELP,
    Placement,
    resolve_placement,
)
from foundation.target import stop_token_ids
from foundation.target_vocab import TargetVocabulary, mask_token_problems

METHODS = ("dflash", "ddtree")
MODES = ("live", "offline")


def mask_token_notes(mask_token_id: int, target: TargetVocabulary) -> list[str]:
    """τ is still measured, but a mask id the target uses for something else is said (PITFALLS #34)."""
    limits = {"vocabulary": target.config_vocab_size, "embedding": target.embedding_rows}
    return [f"the drafter's mask token {mask_token_id} is {phrase} (PITFALLS #34; `compare --target` reports it as "
            "a mask_token_validity divergence)" for _, phrase in mask_token_problems(mask_token_id, limits,
                                                                                       target.special_ids)]


def check_options(method: str, mode: str, budget: int, max_new_tokens: int, temperature: float) -> None:
    check_generation_flags(max_new_tokens, budget, temperature)
    if method not in METHODS:
        raise AuditError(f"--method must be one of {list(METHODS)}, got {method!r}")
    if mode not in MODES:
        raise AuditError(f"--mode must be one of {list(MODES)}, got {mode!r}")
    if temperature > 0 and (method == "ddtree" or mode == "offline"):
        raise AuditError("--temperature > 0 needs --method dflash --mode live (DDTree and offline replay are greedy)")


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


def run_eval(drafter_path: Path, target_dir: Path, prompts_path: Path, method: str = "dflash", budget: int = 32,
             mode: str = "live", max_new_tokens: int = 256, temperature: float = 0.0, seed: int = 0,
             json_path: Path | None = None, cache_dir: Path | None = None, chat_template="auto",
             console: Console | None = None, truncate: bool = False, load_options=None,
             placement: Placement = CPU_FLOAT32, memory: dict | None = None, force: bool = False) -> dict | None:
    """Evaluate, print the table and write `json_path` (rank 0); returns the JSON payload there.

    `memory`: free memory handed to the memory plan (`free_on_devices`, `free_on_host`) instead of
    the machine's own, for tests."""
    # Bad flags and inputs are refused before the modelling code (seconds of transformers imports) is imported.
    check_options(method, mode, budget, max_new_tokens, temperature)
    inputs = {"--drafter": drafter_path, "--target": target_dir, "--prompts": prompts_path}
    check_json_output(json_path, inputs, force)
    check_cache_dir(cache_dir, inputs)
    console = console or Console(stderr=True)
    records = load_prompts(prompts_path)  # bad input fails before any model loads
    from dflash_audit.audit.drafter_fit import place_drafter, read_drafter
    from foundation.target import load_target_model, load_tokenizer
    from impl.body_shapes import build_drafter
    from impl.ddtree import require_dflash_family
    from impl.acceptance import acceptance_histogram, mean_acceptance
    from impl.memory_plan import check_plan, plan_memory

    chat = chat_template if isinstance(chat_template, ChatTemplate) else ChatTemplate.parse(chat_template)
    tokenizer, config = load_tokenizer(target_dir)
    chat.check_kwargs(tokenizer)
    spec, state_dict = read_drafter(drafter_path, target_dir, config, load_options)
    if method == "ddtree" and spec.family != "dflash":
        require_dflash_family(build_drafter(spec, state_dict))  # before any prompt is decoded or cached
    prompts, notes = fit_prompts(tokenize_prompts(tokenizer, records, chat), max_new_tokens,
                                 config.max_position_embeddings, truncate, str(prompts_path))
    notes += mask_token_notes(spec.mask_token_id, TargetVocabulary.read(target_dir, tokenizer))
    # Before any target weight is read: does it all fit?
    check_plan(plan_memory(config, placement.dtype, [spec], [ids.shape[1] for _, ids in prompts], max_new_tokens),
               placement, **(memory or {}))
    target = load_target_model(target_dir, placement)
    drafter = place_drafter(spec, state_dict, drafter_path, target)
    for note in notes:
        console.print(f"note: {note}", soft_wrap=True)
    stop_ids = stop_token_ids(tokenizer)
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

    all_rounds = [length for r in results for length in r["rounds"]]
    longest = drafter.spec.longest_round
    payload = {"schema": "dflash-audit/eval/1", "method": method, "mode": mode, "budget": budget if method == "ddtree" else None,
               "max_new_tokens": max_new_tokens, "placement": placement.describe(),
               "chat_template": chat.describe(tokenizer), "prompts": results,
               "mean_tau": mean_acceptance([r["tau"] for r in results]),
               "histogram": acceptance_histogram(all_rounds, longest)}
    rows = [[r["id"], len(r["rounds"]), sum(r["rounds"]) + 1, f"{r['tau']:.2f}"] for r in results]
    print(tabulate(rows, headers=["prompt", "rounds", "new tokens", "τ"], tablefmt="github"))
    print(f"mean τ ({method}, {mode}): {payload['mean_tau']:.3f}   acceptance histogram 0..{longest}: "
          f"{payload['histogram']}")
    where = placement.describe()
    print(f"target and drafter in {where['dtype']} ({where['dtype_source']}) on {where['device']}"
          + (f", target sharded by --device-map {placement.device_map}" if placement.device_map else ""))
    if json_path is not None:
        text = json.dumps(payload, indent=2)
        atomic_write_bytes(Path(json_path), lambda tmp: Path(tmp).write_text(text))
    return payload


def uses_table(prompts: list[str], methods, budgets, temperatures, tau_methods, tau_by, max_samples, table,
               html_path) -> bool:
    """Whether eval runs the τ table (dflash_audit/commands/eval_table.py) rather than one plain prompts file."""
    from foundation.benchmarks.sets import parse_prompts_flag

    many = any(len(values) > 1 for values in (prompts, methods, budgets, temperatures))
    named = any(parse_prompts_flag(value)[0] is not None for value in prompts)
    return bool(table or html_path or tau_methods or tau_by or max_samples is not None or many or named)


def register(app: typer.Typer) -> None:
    @app.command("eval", help=VERBS["eval"])
    def eval_command(
        drafter: Path = typer.Option(..., "--drafter", help="ours ckpt.pt, z-lab dir or speculators dir"),
        target: Path = typer.Option(..., "--target", help="Hugging Face target model directory"),
        prompts: list[str] = typer.Option(..., "--prompts",
                                          help='JSON lines {"id", "prompt"} or {"turns": [...]}, or NAME:PATH, a '
                                               "benchmark's own file (gsm8k, math500, aime, humaneval, mbpp, "
                                               "mt-bench, alpaca, livecodebench; JSON lines or parquet); repeatable"),
        method: list[str] = typer.Option(["dflash"], "--method", help="dflash | ddtree (repeatable with --table)"),
        budget: list[int] = typer.Option([32], "--budget", help="DDTree node budget (repeatable with --table)"),
        mode: str = typer.Option("live", "--mode", help="live | offline (replay from cached hidden states)"),
        max_new_tokens: int = typer.Option(256, "--max-new-tokens"),
        temperature: list[float] = typer.Option([0.0], "--temperature",
                                                help="> 0: rejection sampling (dflash, live); repeatable with --table"),
        seed: int = typer.Option(0, "--seed", help="sampling seed when --temperature > 0"),
        seeds: str | None = typer.Option(None, "--seeds", help="comma-separated sampling seeds for the table at T > 0 "
                                                               "(τ per seed and the range across them)"),
        json_path: Path | None = typer.Option(None, "--json", help="write the results as JSON here"),
        cache: Path | None = typer.Option(None, "--cache-dir",
                                          help="cache root; offline hidden states go to <root>/offline "
                                               "(default $XDG_CACHE_HOME/dflash-audit)"),
        chat_template: str = typer.Option("auto", "--chat-template", help=CHAT_TEMPLATE_HELP),
        chat_template_kwargs: str | None = typer.Option(None, "--chat-template-kwargs",
                                                        help='JSON for apply_chat_template, e.g. {"enable_thinking": false}'),
        tau_method: list[str] = typer.Option([], "--tau-method",
                                             help="live | zlab-loop | teacher-forced | zlab-benchmark (repeatable)"),
        tau_by: str | None = typer.Option(None, "--tau-by", help="thinking: τ with thinking on and off"),
        table: bool = typer.Option(False, "--table", help="τ per set x method x temperature (terminal, --json, --html)"),
        html_path: Path | None = typer.Option(None, "--html", help="write the τ table as HTML here"),
        max_samples: int | None = typer.Option(None, "--max-samples",
                                               help="prompts per set, chosen by z-lab's seeded selection"),
        published: str | None = typer.Option(None, "--published",
                                             help="set the published figures of this target beside the cells "
                                                  "(default: when the target directory is named like one)"),
        trained_kwargs: str | None = typer.Option(None, "--trained-chat-template-kwargs",
                                                  help="the chat-template kwargs the drafter was trained with (JSON), "
                                                       "when its config does not declare them"),
        entry: str | None = typer.Option(None, "--entry", help="entry of a training dict holding the state dict"),
        key_map: Path | None = typer.Option(None, "--key-map", help="parameter names: 'PATTERN => REPLACEMENT'"),
        spec: list[str] = typer.Option([], "--spec", help="KEY=VALUE spec/recipe field (repeatable)"),
        truncate: bool = typer.Option(False, "--truncate",
                                      help="keep a too-long prompt's last tokens (default: refuse it)"),
        device: str = typer.Option("auto", "--device", help=DEVICE_HELP),
        dtype: str = typer.Option("auto", "--dtype", help=DTYPE_HELP),
        device_map: str | None = typer.Option(None, "--device-map", help=DEVICE_MAP_HELP),
        force: bool = typer.Option(False, "--force", help="replace a --json file the tool did not write"),
    ) -> None:
        from dflash_audit.formats import LoadOptions

        chat = ChatTemplate.parse(chat_template, chat_template_kwargs)
        options = LoadOptions(entry, key_map, list(spec), flag_prefix="")
        if uses_table(prompts, method, budget, temperature, tau_method, tau_by, max_samples, table, html_path):
            from dflash_audit.tau.prompt_sets import prompt_set_from_flag
            from dflash_audit.commands.eval_table import run_table

            if mode != "live":
                raise AuditError("--mode offline replays plain prompts files; the τ table runs its τ methods "
                                 "(--tau-method)")
            prompt_sets = [prompt_set_from_flag(value, max_samples) for value in prompts]  # before any model
            run_table(drafter, target, prompt_sets, tau_method, method, budget, temperature, seeds or str(seed),
                      max_new_tokens, chat, tau_by, max_samples, json_path, html_path, published, trained_kwargs,
                      options, resolve_placement(device, dtype, device_map, target), force=force)
            return
        placement = resolve_placement(device, dtype, device_map, target)
        run_eval(drafter, target, Path(prompts[0]), method[0], budget[0], mode, max_new_tokens, temperature[0], seed,
                 json_path, cache, chat, truncate=truncate, load_options=options, placement=placement,
                 force=force)

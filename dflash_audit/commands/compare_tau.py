"""The τ half of `compare` (`--target` without `--static-only`): the target, the prompts, the memory plan, then the
dynamic audit in each dtype. Its own module so that a static compare never imports the decoding loops or the
target's modelling code (tests/test_start_fast.py pins what a static compare imports)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from rich.console import Console

from dflash_audit.audit.dynamic import dtype_findings, dynamic_audit, progress_passes
from dflash_audit.progress import progress
from dflash_audit.prompts import fit_prompts, load_prompts, tokenize_prompts
from dflash_audit.ranks import Ranks
from dflash_world import BUILTIN_PROMPTS
from foundation.placement import Placement, resolve_dtype
from foundation.target import load_target_model, load_tokenizer
from impl.memory_plan import check_plan, plan_memory


def load_prompt_ids(prompts_file: Path | None, tokenizer, chat=None) -> tuple[list[tuple[str, torch.Tensor]], str]:
    """[(id, input_ids)] from a prompts file (JSON lines) or the built-in coding prompts, rendered by `chat`
    (a `ChatTemplate`; None: the tokenizer's own template when it has one)."""
    if prompts_file is None:
        prompts, source = BUILTIN_PROMPTS, "built-in"
    else:
        prompts, source = load_prompts(prompts_file), str(prompts_file)
    return tokenize_prompts(tokenizer, prompts, chat if chat is not None else "auto"), source


def dynamic_audits(ours_side, ref_side, target: Path, prompts: Path | None, max_new_tokens: int, budget: int,
                   cache_dir: Path | None, console: Console, truncate: bool, placement: Placement,
                   dtypes: list[str | None], notes: list[str], ranks: Ranks, chat=None):
    """The τ audit in each dtype (None: the placement's own), after a memory plan that fits; the first
    dtype's audit carries every dtype's summary and the findings of a drop between them."""
    tokenizer, config = load_tokenizer(target)
    if chat is not None:  # recorded in the report: the template and its kwargs move τ as much as a bug
        chat.check_kwargs(tokenizer)
        notes.append(f"chat template: {json.dumps(chat.describe(tokenizer))}")
    prompt_list, source = load_prompt_ids(prompts, tokenizer, chat)
    prompt_list, fit_notes = fit_prompts(prompt_list, max_new_tokens, config.max_position_embeddings, truncate,
                                         source)
    notes.extend(fit_notes)
    runs = [placement if name is None else placement.with_dtype(*resolve_dtype(name, target)) for name in dtypes]
    audits = {}
    for run in runs:
        check_plan(plan_memory(config, run.dtype, [ours_side.spec, ref_side.spec],
                               [ids.shape[1] for _, ids in prompt_list], max_new_tokens), run)
        target_model = load_target_model(target, run)
        # In tokens: the target's pass over each prompt (none when cached), then each drafter's per method.
        with progress(console, f"dynamic audit ({run.describe()['dtype']})", len(prompt_list), max_new_tokens,
                      progress_passes(ours_side, ref_side, budget), enabled=ranks.rank == 0) as bar:
            audit = dynamic_audit(ours_side, ref_side, target, target_model, tokenizer, prompt_list, source,
                                  max_new_tokens, budget, cache_dir, progress=bar, ranks=ranks)
        audit.precision.update({k: v for k, v in run.describe().items() if k not in ("dtype", "device")})
        audits[audit.precision["target_dtype"]] = audit
        del target_model  # one target in memory at a time
    main = next(iter(audits.values()))
    if len(audits) > 1:
        main.by_dtype = {name: audit.summary() for name, audit in audits.items()}
        main.findings += [f for audit in list(audits.values())[1:] for f in audit.findings
                          if f.key.startswith("overflow")]
        main.findings += dtype_findings(audits)
    return main

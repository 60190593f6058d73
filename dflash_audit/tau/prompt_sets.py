"""`--prompts` values: a benchmark's own file (`NAME:PATH`) or a plain prompts file (`PATH`), as prompt sets."""

from __future__ import annotations

from pathlib import Path

from foundation.benchmarks.sets import BenchmarkPrompt, PromptSet, parse_prompts_flag, read_prompt_set, select


def plain_prompt_set(path: str | Path, max_samples: int | None = None) -> PromptSet:
    """A plain prompts file (`{"id", "prompt"}` or `{"turns"}` lines), through the existing reader."""
    from dflash_audit.prompts import load_prompts

    records = load_prompts(path)
    prompts = [BenchmarkPrompt(r["id"], [r["prompt"]], None) for r in records]
    chosen = prompts if max_samples is None else select(prompts, max_samples)
    return PromptSet("prompts", Path(path), chosen, "the 'prompt' field (or first of 'turns') as written",
                     rows=len(prompts), selection="all rows, file order" if max_samples is None else
                     f"{len(chosen)} of {len(prompts)} by z-lab's seeded selection (_select_dataset, seed 42)")


def prompt_set_from_flag(value: str, max_samples: int | None = None) -> PromptSet:
    name, path = parse_prompts_flag(value)
    return plain_prompt_set(path, max_samples) if name is None else read_prompt_set(name, path, max_samples)

"""The audit's side: z-lab's loop (`impl.decoding.dflash_decode`, conformance-tested against z-lab's
`dflash_generate`) replayed with the drafter as the audit has it, on the source's own prompts and stop ids."""

from __future__ import annotations

import torch

from dflash_audit.rounds.source import PromptRounds


def built(spec, state: dict[str, torch.Tensor], target):
    """The drafter of `spec` with weights `state`, in the target's dtype, for a replay."""
    from impl.body_shapes import build_drafter

    return build_drafter(spec, state, dtype=target.dtype).eval()


def zlab_replay(drafter, target, prompts: list[PromptRounds] | list[dict], max_new_tokens: int, stop_ids: list[int],
                whole_blocks: bool = False) -> list:
    """One `DecodeResult` per prompt (`PromptRounds`, or the live checks' {"id", "ids"}), greedy. `whole_blocks`:
    every round drafts the whole block, its proposals cut to what is left (an engine's way near its budget's end),
    where z-lab shrinks the block."""
    from impl.decoding import dflash_decode

    ids = [p.prompt_ids if isinstance(p, PromptRounds) else p["ids"] for p in prompts]
    return [dflash_decode(drafter, target, torch.tensor([i]), max_new_tokens, stop_ids,
                          whole_blocks=whole_blocks) for i in ids]


def load_prompts_for(target_dir, prompts_path, tokenizer, max_new_tokens: int | None = None,
                     max_positions: int | None = None) -> list[dict]:
    """The prompts every source and the replay run ({"id", "ids"}): a prompts file's, else the test world's
    built-in ones, tokenized as `eval` tokenizes them. With `max_new_tokens` and the target's `max_positions`, a
    prompt whose length and new tokens go past them is refused as `eval` refuses it (`prompts.fit_prompts`)."""
    from dflash_audit.prompts import fit_prompts, load_prompts, tokenize_prompt
    from dflash_world import BUILTIN_PROMPTS

    prompts = BUILTIN_PROMPTS if prompts_path is None else load_prompts(prompts_path)
    tokenized = [(p["id"], tokenize_prompt(tokenizer, p)) for p in prompts]
    if max_new_tokens is not None and max_positions is not None:
        tokenized, _ = fit_prompts(tokenized, max_new_tokens, max_positions, False,
                                   str(prompts_path or "the built-in prompts"))
    return [{"id": prompt_id, "ids": ids[0].tolist()} for prompt_id, ids in tokenized]

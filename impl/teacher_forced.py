"""Teacher-forced τ on a fixed ground truth: the offline replay's walk, over prompt + reference answer.

The offline replay (impl/offline) walks a cached *greedy continuation*; here the cached sequence is
the dataset's reference answer instead, read by the target in one forward. Everything else -- the
drafter's blocks at each anchor, the prefix match, the bonus step, the block shrinking near the end --
is the same walk.
"""

from __future__ import annotations

import functools

import torch

from impl.extract import output_head
from impl.layers import hidden_state_index
from impl.offline.cache import CachedPrompt
from impl.offline.walks import play_ddtree, play_dflash, replay_walks
from foundation.placement import target_device


@torch.inference_mode()
def ground_truth_entry(target, prompt_ids: torch.Tensor, answer_ids: list[int], layer_ids: list[int],
                       prompt_id: str = "0") -> CachedPrompt:
    """prompt + answer as a cache entry: the target's states of every position, from one forward."""
    device = target_device(target)
    tokens = torch.cat([prompt_ids[0].to(device), torch.tensor(answer_ids, dtype=torch.long, device=device)])
    out = target(tokens[None], output_hidden_states=True, logits_to_keep=1)
    layers = {i: out.hidden_states[hidden_state_index(i)][0] for i in layer_ids}
    return CachedPrompt(prompt_id, tokens, prompt_ids.shape[1], layers, torch.zeros(len(tokens)))


def teacher_forced_rounds(drafter, target, prompt_ids: torch.Tensor, answer_ids: list[int], decode: str = "dflash",
                          budget: int = 32) -> list[int]:
    """Per-round accepted lengths (bonus included) walking the reference answer `answer_ids`."""
    entry = ground_truth_entry(target, prompt_ids, answer_ids, drafter.target_layer_ids)
    head = output_head(target)
    play = (functools.partial(play_ddtree, drafter, head, budget=budget) if decode == "ddtree"
            else functools.partial(play_dflash, drafter, head))
    return replay_walks(drafter, target, [entry], len(answer_ids), play)[0]

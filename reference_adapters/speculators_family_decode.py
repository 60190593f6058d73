"""Greedy speculative decoding whose every proposal comes from speculators' own DSpark or XPress model.

speculators 0.9.0 has no inference loop: it trains, and vLLM serves (`DSparkSpeculator._sample_sequential`,
`XPressSpeculator._jacobi_refine`). This loop drives speculators' own modules the way those runners chain them,
with nothing of ours in between:
- the block `[anchor, mask x (B - 1)]` through its decoder layers after the target's context features
  (`SpeculatorsImplementation.draft_forward`: its own layers, masks and rotary), then its `lm_head`;
- its heads' proposals (reference_adapters/speculators_family_heads.py).
The target is rerun on the whole sequence every round (no cache): slow, and independent of our loop's cache.
τ per prompt from this loop is what `dflash_decode` must reproduce.
"""

from __future__ import annotations

import torch
from torch import nn

from reference_adapters.speculators_adapter import SpeculatorsImplementation
from reference_adapters.speculators_family_heads import jacobi_tokens, markov_tokens


@torch.no_grad()
def speculators_rounds(model, target: nn.Module, input_ids: torch.Tensor, max_new_tokens: int,
                       stop_token_ids: list[int] | None = None) -> tuple[list[int], list[int]]:
    """(acceptance length of each round, generated ids) of greedy decoding with speculators' model `model`."""
    adapter = SpeculatorsImplementation()
    stops = set(stop_token_ids or ())
    tokens = input_ids[0].tolist()
    prompt_len, block = len(tokens), model.block_size
    first = 0 if model.config.sample_from_anchor else 1
    max_length = prompt_len + max_new_tokens
    tokens.append(int(target(input_ids).logits[0, -1].argmax()))
    start, rounds = prompt_len, []
    while tokens[start] not in stops and start + 1 < max_length:
        count = min(block - first, max_length - start - 1)
        states = target(torch.tensor([tokens[:start]]), output_hidden_states=True).hidden_states
        features = torch.cat([states[j] for j in model.target_layer_ids], dim=-1)
        ids = torch.full((1, block), model.mask_token_id, dtype=torch.long)
        ids[0, 0] = tokens[start]
        hidden = adapter.draft_forward(model, model.embed_tokens(ids), features, torch.arange(start + block)[None])
        base = model.lm_head(hidden)
        if getattr(model, "refiner_head", None) is not None:
            proposals = jacobi_tokens(model, hidden, base, tokens[start], tokens[start - 1])
        else:
            proposals = markov_tokens(model, hidden, base, tokens[start], first)
        proposals = proposals[:count]
        verified = target(torch.tensor([tokens[: start + 1] + proposals])).logits[0, start:].argmax(-1).tolist()
        accepted = 0
        while accepted < len(proposals) and proposals[accepted] == verified[accepted]:
            accepted += 1
        produced = (proposals[:accepted] + [verified[accepted]])[: max_length - start - 1]
        for index, token in enumerate(produced):  # a stop token ends the round and the generation
            if token in stops:
                produced = produced[: index + 1]
                break
        tokens.extend(produced)
        rounds.append(len(produced))
        start += len(produced)
    return rounds, tokens[:max_length]

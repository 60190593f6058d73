"""The cache's continuation by greedy speculative decoding with a drafter: lossless under greedy
verification, in about τ times fewer target passes than one token per pass.

The live DFlash loop's own pieces (`TargetSession`, `draft_block`, `propose`, `verify_greedy`),
with the target session reading the union of layers the cache keeps: each verified block's
accepted rows are the states of those positions, so nothing is computed twice. The last token
(the final round's bonus) gets one one-token forward for its own states and margin.
"""

from __future__ import annotations

import torch
from torch import nn

from foundation.placement import target_device
from impl.decoding import (
    Sampler,
    StopTokens,
    TargetSession,
    draft_block,
    propose,
    round_size,
    verify_block,
    verify_greedy,
)
from impl.extract import output_head
from impl.model import DFlashDrafter, DraftCache
from impl.offline.capture import Captured, top2_margin


@torch.inference_mode()
def capture_speculative(target: nn.Module, drafter: DFlashDrafter, prompt: torch.Tensor, layer_ids: list[int],
                        max_new_tokens: int, stop_token_ids: list[int]) -> tuple[Captured, int]:
    """(the greedy continuation of `prompt` [T] with the states of `layer_ids`, the number of target passes)."""
    device = target_device(target)
    layer_ids = list(layer_ids)
    # The drafter reads its own layers out of the session's union ([.., len(union) * H]).
    union = sorted(set(layer_ids) | set(drafter.target_layer_ids))
    columns = [union.index(i) for i in drafter.target_layer_ids]
    sampler, stops, head = Sampler(0.0, 0), StopTokens(stop_token_ids), output_head(target)
    session, draft_cache = TargetSession(target, union), DraftCache(drafter.spec.num_hidden_layers)
    prompt_len, max_length = len(prompt), len(prompt) + max_new_tokens

    def drafter_view(features: torch.Tensor) -> torch.Tensor:
        per_layer = features.view(*features.shape[:-1], len(union), -1)
        return per_layer[..., columns, :].flatten(-2)

    logits, features = session.forward(prompt[None].to(device), 0, logits_to_keep=0)
    kept, margins, passes = [features[0]], [top2_margin(logits)], 1
    tokens = prompt.tolist() + [int(logits[-1].argmax())]
    start = prompt_len
    stopped = tokens[start] in stops.ids
    new_features = drafter_view(features)
    while not stopped and start + 1 < max_length:
        _, size = round_size(drafter, start, max_length)
        _, draft_hidden = draft_block(drafter, target, draft_cache, new_features, tokens[start], start, size)
        proposals, _ = propose(drafter, head, draft_hidden, tokens[start], sampler)
        target_logits, block_features = session.forward(verify_block(tokens[start], proposals), start)
        passes += 1
        accepted, bonus = verify_greedy(proposals, target_logits)
        produced, stopped = stops.cut((proposals[:accepted].tolist() + [bonus])[: max_length - start - 1])
        tokens.extend(produced)
        # The block's first token plus every accepted one: their states are final.
        kept.append(block_features[0, :len(produced)])
        margins.append(top2_margin(target_logits[:len(produced)]))
        new_features = drafter_view(block_features[:, :len(produced)])
        start += len(produced)
        session.keep(start)
    logits, features = session.forward(torch.tensor([[tokens[start]]], device=device), start)  # the last token
    kept.append(features[0])
    margins.append(top2_margin(logits))
    passes += 1
    states = torch.cat(kept).view(len(tokens), len(union), -1)
    layers = {i: states[:, union.index(i)].cpu().contiguous() for i in layer_ids}
    return Captured(torch.tensor(tokens, device="cpu"), prompt_len, layers, torch.cat(margins).cpu()), passes

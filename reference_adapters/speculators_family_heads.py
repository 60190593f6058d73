"""Proposals of one whole block from speculators' own DSpark and XPress heads, chained as vLLM's runners chain them.

speculators 0.9.0 has no inference loop, so nothing of its own walks the heads at inference; these helpers call
only its modules:
- DSpark: left to right, slot s's bias from its own `markov_head.block_bias` over the chain so far (an rnn
  head's state restarts with each call, so the whole prefix is passed and its last slot read);
- XPress: its own `refiner_head.hidden_cache` once, then `num_jacobi_passes` calls of `block_bias` on the
  previous pass's argmax, exactly as its training's consistency rounds feed them.
"""

from __future__ import annotations

import torch


def markov_tokens(model, hidden: torch.Tensor, base: torch.Tensor, anchor: int, first: int) -> list[int]:
    """Greedy proposals of a block (hidden [1, B, H], base logits [1, B, V]) whose first slot follows `anchor`."""
    prev, tokens = [anchor], []
    for slot in range(hidden.shape[1]):
        ids = torch.tensor([prev], device=hidden.device)
        bias = model.markov_head.block_bias(prev_token_ids=ids, hidden_states=hidden[:, : slot + 1])[:, -1]
        if slot < first:
            prev.append(anchor)  # the anchor-as-bonus layout: slot 1 follows the anchor too
            continue
        choice = int((base[:, slot] + bias).argmax(-1))
        tokens.append(choice)
        prev.append(choice)
    return tokens


def jacobi_tokens(model, hidden: torch.Tensor, base: torch.Tensor, anchor: int, before: int) -> list[int]:
    """Greedy proposals of a block after its `num_jacobi_passes` passes; `before` is the token before the anchor."""
    head, layout = model.refiner_head, model.config.sample_from_anchor
    hcache = head.hidden_cache(hidden.to(head.down_h.weight.dtype))
    pred = base.argmax(-1)
    anchor_t, before_t = torch.tensor([[anchor]]), torch.tensor([[before]])
    for _ in range(model.config.num_jacobi_passes):
        if layout:
            prev = torch.cat([anchor_t, pred[:, :-1]], dim=1)
        else:
            pred[:, :1] = anchor_t
            prev = torch.cat([before_t, pred[:, :-1]], dim=1)
        pred = (base + head.block_bias(prev, hcache=hcache)).argmax(-1)
    return pred[0, 0 if layout else 1:].tolist()

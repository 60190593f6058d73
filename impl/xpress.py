"""The causal refiner XPress adds to a DFlash drafter, and its Jacobi resolution of a block.

The refiner turns a block's hidden states h [B, H] and each slot's previous token into a logit bias:
    hcache = [down_h(h_k) ; down_g(mean_j h_j)]                    (once per block)
    x_k    = in_proj([hcache_k ; token_embed(prev_k)])
    x_k   += sum_{j <= k} L[:, k, j] * x_j                          (the causal mixer, per rank channel)
    x_k   += mlp_down(silu(mlp_gate(x_k)) * mlp_up(x_k))
    bias_k = readout(x_k)
Slot k's previous token is the one at the position before the one it proposes; in the anchor-as-bonus
layout (XPress's) slot 0 is the anchor and follows the token before it.

Jacobi resolution (inference; speculators' consistency rounds in training): start from the drafter's own
argmax, then `num_jacobi_passes` times re-feed every slot the previous pass's choices and take the argmax of
logits + bias, all slots at once. Zero passes propose the backbone's argmax.
Tensor names are speculators' (`refiner_head.token_embed.weight`, `refiner_head.mix_l`, ...).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RefinerHead(nn.Module):
    def __init__(self, vocab_size: int, head_size: int, hidden_size: int, block_size: int, rank: int, mlp_ratio: int):
        super().__init__()
        self.token_embed = nn.Embedding(vocab_size, rank)
        self.down_h = nn.Linear(hidden_size, rank, bias=False)
        self.down_g = nn.Linear(hidden_size, rank, bias=False)
        self.in_proj = nn.Linear(3 * rank, rank, bias=False)
        self.mix_l = nn.Parameter(torch.zeros(rank, block_size, block_size))  # [r, k, j], lower triangle used
        self.mlp_gate = nn.Linear(rank, rank * mlp_ratio, bias=False)
        self.mlp_up = nn.Linear(rank, rank * mlp_ratio, bias=False)
        self.mlp_down = nn.Linear(rank * mlp_ratio, rank, bias=False)
        self.readout = nn.Linear(rank, head_size, bias=False)

    def reset_parameters(self) -> None:
        """A no-op residual at first: the mixer at zero (speculators' recipe; the linears are drawn with the rest)."""
        with torch.no_grad():
            self.mix_l.zero_()
            nn.init.normal_(self.token_embed.weight, std=0.02)

    def hidden_cache(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, B, H] -> [N, B, 2r]: what every pass over the block reuses."""
        hidden = hidden.to(self.down_h.weight.dtype)
        summary = hidden.mean(dim=1, keepdim=True).expand_as(hidden)
        return torch.cat([self.down_h(hidden), self.down_g(summary)], dim=-1)

    def block_bias(self, prev_ids: torch.Tensor, hcache: torch.Tensor) -> torch.Tensor:
        """[N, B, V] biases from each slot's previous token [N, B] and the block's cache [N, B, 2r]."""
        x = self.in_proj(torch.cat([hcache, self.token_embed(prev_ids.long()).to(hcache.dtype)], dim=-1))
        size = x.shape[1]
        mixer = torch.tril(self.mix_l[:, :size, :size])
        x = x + torch.einsum("rkj,njr->nkr", mixer.to(x.dtype), x)
        x = x + self.mlp_down(F.silu(self.mlp_gate(x)) * self.mlp_up(x))
        return self.readout(x)


def previous_tokens(block: torch.Tensor, before_anchor: torch.Tensor, sample_from_anchor: bool) -> torch.Tensor:
    """Each slot's previous token from a block's tokens [N, B] (slot 0 the anchor; training: the true tokens,
    inference: the current choices) and the token before each anchor [N]."""
    if sample_from_anchor:
        return block
    return torch.cat([before_anchor[:, None], block[:, :-1]], dim=1)


def jacobi_resolve(head: RefinerHead, hidden: torch.Tensor, base_logits: torch.Tensor, anchor: torch.Tensor,
                   before_anchor: torch.Tensor, passes: int, sample_from_anchor: bool) -> torch.Tensor:
    """Greedy proposals [N, S - first] of whole blocks: hidden [N, S, H], base logits [N, S, V], anchors [N]."""
    hcache = head.hidden_cache(hidden)
    choice = base_logits.argmax(-1)
    for _ in range(passes):
        if sample_from_anchor:  # slot k proposes p + k + 1 and follows p + k: the anchor, then the choices
            prev = torch.cat([anchor[:, None], choice[:, :-1]], dim=1)
        else:  # slot 0 holds the anchor; slot k follows slot k - 1
            prev = previous_tokens(torch.cat([anchor[:, None], choice[:, 1:]], dim=1), before_anchor, False)
        choice = (base_logits + head.block_bias(prev, hcache).to(base_logits.dtype)).argmax(-1)
    return choice if sample_from_anchor else choice[:, 1:]

"""Anchors and their blocks: which positions training drafts from (speculators' rule), the positions of each
block, and the block a drafter reads at an anchor (the anchor's token, the last one known, in slot 0, the mask
token in every other slot), which decoding, the offline replay and training all build here."""

from __future__ import annotations

import torch


def select_anchors(loss_mask: torch.Tensor, max_anchors: int, block_size: int,
                   generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Uniform without replacement over loss-masked positions, excluding the last block.

    Returns `(anchors [max_anchors], valid [max_anchors])`: sorted anchors first, unused
    slots zero and marked invalid (their blocks are masked out of the loss).
    """
    if loss_mask.ndim != 2 or loss_mask.shape[0] != 1:
        raise ValueError(f"loss_mask must be [1, T], got {tuple(loss_mask.shape)}")
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    eligible = loss_mask[0].bool().clone()
    eligible[-block_size:] = False  # a block must fit inside the sequence
    candidates = eligible.nonzero().squeeze(-1)
    count = min(max_anchors, candidates.numel())
    # Same draw as speculators (randperm over the candidates) so a shared seed gives the same anchors.
    order = torch.randperm(candidates.numel(), device=loss_mask.device, generator=generator)
    anchors = torch.zeros(max_anchors, dtype=torch.long, device=loss_mask.device)
    valid = torch.zeros(max_anchors, dtype=torch.bool, device=loss_mask.device)
    anchors[:count] = candidates[order[:count]].sort().values
    valid[:count] = True
    return anchors, valid


def block_indices(anchors: torch.Tensor, block_size: int) -> torch.Tensor:
    """Base positions of every block slot: anchor + 0..B-1, flattened to [A*B]."""
    return (anchors.reshape(-1, 1).long() + torch.arange(block_size, device=anchors.device)).reshape(-1)


def anchor_blocks(anchor_tokens: torch.Tensor, block_size: int, mask_token_id: int) -> torch.Tensor:
    """[A, block_size] token ids: row j is `[anchor_tokens[j], mask, ..., mask]`."""
    blocks = torch.full((anchor_tokens.numel(), block_size), mask_token_id, dtype=torch.long,
                        device=anchor_tokens.device)
    blocks[:, 0] = anchor_tokens.reshape(-1)
    return blocks

"""The block a drafter reads at an anchor: the anchor's token (the last one known) in slot 0, the mask token in
every other slot. Decoding, the offline replay and training all build it here."""

from __future__ import annotations

import torch


def anchor_blocks(anchor_tokens: torch.Tensor, block_size: int, mask_token_id: int) -> torch.Tensor:
    """[A, block_size] token ids: row j is `[anchor_tokens[j], mask, ..., mask]`."""
    blocks = torch.full((anchor_tokens.numel(), block_size), mask_token_id, dtype=torch.long,
                        device=anchor_tokens.device)
    blocks[:, 0] = anchor_tokens.reshape(-1)
    return blocks

"""Training targets: the verifier's logits, aligned to the drafter's block slots.

Targets come from the raw output of the verifier's final decoder layer, through the
verifier norm and LM head exactly once. DFlash (`sample_from_anchor=False`): slot 0 is
the anchor (an input, untrained) and slot k >= 1 at position a + k is trained toward the
target logits computed at position a + k - 1 (which predict the token at a + k).
Sample-from-anchor (impl/slot_layout.py): slot k toward the logits at a + k, slot 0 trained.
"""

from __future__ import annotations

import torch
from torch import nn

from impl.anchors import block_indices
from impl.slot_layout import first_proposing_slot, target_shift


class TargetAligner:
    """Gathers verifier logits and the loss mask at every block slot."""

    shift = target_shift(False)  # slot k <- position a + k - shift (sample-from-anchor: no shift)

    def __init__(self, block_size: int, sample_from_anchor: bool = False):
        self.block_size = block_size
        self.sample_from_anchor = sample_from_anchor

    def indices(self, anchors: torch.Tensor, total_len: int) -> torch.Tensor:
        slots = block_indices(anchors, self.block_size)
        shift = target_shift(True) if self.sample_from_anchor else self.shift
        return (slots - shift) % total_len

    @torch.no_grad()
    def target_logits(self, source_states: torch.Tensor, verifier_norm: nn.Module, verifier_head: nn.Module,
                      anchors: torch.Tensor) -> torch.Tensor:
        """[1, A*B, V] from raw verifier states [1, T, H] (never pre-normalised ones)."""
        picked = source_states[:, self.indices(anchors, source_states.shape[1])]
        return verifier_head(verifier_norm(picked))

    def loss_mask(self, loss_mask: torch.Tensor, anchors: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """[1, A*B]: the data's loss mask at each slot, zero for padded anchors and (DFlash) slot 0."""
        aligned = loss_mask[:, block_indices(anchors, self.block_size)].float()
        aligned = aligned * valid.repeat_interleave(self.block_size)[None].float()
        if first_proposing_slot(self.sample_from_anchor) > 0:
            aligned[:, :: self.block_size] = 0  # the anchor slot proposes nothing
        return aligned

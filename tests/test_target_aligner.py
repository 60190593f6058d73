"""Our target alignment on its own (which position trains which slot); its parity with
speculators, and the losses', lives in `conformance/` (#5, #6, #7, #17)."""

import torch

from impl.target_alignment import TargetAligner


def test_targets_align_slot_k_to_position_anchor_plus_k_minus_one():
    T, H = 12, 4
    states = torch.arange(T, dtype=torch.float32)[None, :, None].expand(1, T, H).clone()
    aligner = TargetAligner(block_size=3)
    identity = torch.nn.Identity()
    logits = aligner.target_logits(states, identity, identity, torch.tensor([2, 6]))
    assert logits[0, :, 0].tolist() == [1, 2, 3, 5, 6, 7]
    dspark = TargetAligner(block_size=3, sample_from_anchor=True).target_logits(states, identity, identity,
                                                                                 torch.tensor([2]))
    assert dspark[0, :, 0].tolist() == [2, 3, 4]


def test_aligned_loss_mask_drops_slot_zero_and_padded_anchors():
    loss_mask = torch.ones(1, 10)
    aligner = TargetAligner(block_size=2)
    mask = aligner.loss_mask(loss_mask, torch.tensor([3, 0]), torch.tensor([True, False]))
    assert mask.tolist() == [[0, 1, 0, 0]]

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from impl.anchors import block_indices, select_anchors
from impl.masks import inference_mask, training_mask


def test_training_mask_small_example_by_hand():
    docs = torch.tensor([0, 0, 0, 1, 1, 1, 1, 1])
    anchors = torch.tensor([2, 5])
    mask = training_mask(docs, anchors, block_size=2)
    assert mask.shape == (4, 8 + 4)
    base, blocks = mask[:, :8], mask[:, 8:]
    # block of anchor 2 (doc 0) sees positions 0, 1 strictly before the anchor
    assert base[0].tolist() == [True, True, False, False, False, False, False, False]
    # block of anchor 5 (doc 1) sees 3, 4 only: not doc 0, not the anchor itself
    assert base[2].tolist() == [False, False, False, True, True, False, False, False]
    # full attention inside its own block only
    assert blocks.tolist() == [[True, True, False, False]] * 2 + [[False, False, True, True]] * 2


def test_training_mask_sliding_window_and_causal_block():
    docs = torch.zeros(10, dtype=torch.long)
    mask = training_mask(docs, torch.tensor([7]), block_size=3, sliding_window=2, causal_block=True)
    assert mask[0, :10].nonzero().flatten().tolist() == [5, 6]
    assert mask[:, 10:].tolist() == [[True, False, False], [True, True, False], [True, True, True]]


def test_padding_documents_are_never_visible():
    docs = torch.tensor([-1, -1, 0, 0, 0, 0])
    mask = training_mask(docs, torch.tensor([1, 4]), block_size=1)
    assert not mask[0, :6].any()  # anchor in padding sees no base token
    assert mask[1, :6].nonzero().flatten().tolist() == [2, 3]


def test_inference_mask_full_and_sliding():
    assert inference_mask(3, 2).all()
    sliding = inference_mask(3, 2, sliding_window=2, causal=True)
    # query positions 3, 4; keys 0..4; visible when k <= q and q - k < 2
    assert sliding.tolist() == [[False, False, True, True, False], [False, False, False, True, True]]


@settings(max_examples=50, deadline=None)
@given(st.integers(10, 80), st.integers(1, 8), st.integers(1, 20), st.integers(0, 2**31 - 1))
def test_anchor_properties(length, block_size, max_anchors, seed):
    loss_mask = (torch.rand(1, length, generator=torch.Generator().manual_seed(seed)) > 0.3).long()
    anchors, valid = select_anchors(loss_mask, max_anchors, block_size, torch.Generator().manual_seed(seed))
    picked = anchors[valid]
    eligible = loss_mask[0].bool().clone()
    eligible[-block_size:] = False
    assert valid.sum() == min(max_anchors, int(eligible.sum()))
    assert torch.equal(picked, picked.sort().values) and picked.unique().numel() == picked.numel()
    assert bool(eligible[picked].all())
    assert (anchors[~valid] == 0).all()
    assert (block_indices(picked, block_size) < length).all()

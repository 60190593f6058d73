import pytest
import torch
from speculators.losses import dflash_loss_decay
from speculators.losses.eager import ce_loss, kl_div_loss
from speculators.losses.utils import loss_function

from impl.losses import block_metrics, decay_weights, dflash_loss, elementwise_loss
from impl.targets import TargetAligner


@pytest.mark.parametrize("sample_from_anchor", [False, True])
@pytest.mark.parametrize("gamma", [4.0, 7.0])
def test_decay_weights_equal_speculators(gamma, sample_from_anchor):
    ours = decay_weights(8, gamma, sample_from_anchor)
    ref = dflash_loss_decay(torch.arange(8, dtype=torch.float32), gamma=gamma, sample_from_anchor=sample_from_anchor)
    torch.testing.assert_close(ours, ref, rtol=0, atol=0)
    if not sample_from_anchor:
        assert ours[0] == 0 and ours[1] == 1


@pytest.mark.parametrize("kind, ref_fn", [("kl_div", kl_div_loss), ("ce", ce_loss)])
def test_loss_and_reduction_equal_speculators(kind, ref_fn):
    torch.manual_seed(0)
    block, blocks, vocab = 4, 5, 33
    logits, targets = torch.randn(1, block * blocks, vocab), torch.randn(1, block * blocks, vocab)
    mask = (torch.rand(1, block * blocks) > 0.3).float()
    pos = (torch.arange(block * blocks) % block)[None]
    ref = loss_function(logits, targets, mask, pos, loss_fn=ref_fn,
                        decay_fn=lambda p, **_: dflash_loss_decay(p, gamma=4.0))
    ours = dflash_loss(logits, targets, mask, block, gamma=4.0, kind=kind)
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(elementwise_loss(logits, targets, kind), ref_fn(logits, targets))


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


def test_block_metrics_match_speculators_compute_metrics():
    from speculators.losses import resolve_loss_config
    from speculators.models.dflash.metrics import compute_metrics

    torch.manual_seed(1)
    block, vocab = 4, 7
    logits, targets = torch.randn(1, block * 6, vocab), torch.randn(1, block * 6, vocab)
    mask = torch.ones(1, block * 6)
    mask[:, ::block] = 0
    mask[:, -block:] = 0
    _, ref = compute_metrics(logits, targets, mask, block, loss_config=resolve_loss_config("kl_div", "eager"))
    ours = block_metrics(logits, targets, mask, block)
    torch.testing.assert_close(ours["eal"], ref["eal_sum"] / ref["eal_total"])
    for pos in range(1, block):
        expected = ref[f"position_{pos}_acc_sum"] / ref[f"position_{pos}_acc_total"]
        torch.testing.assert_close(ours["position_acc"][pos - 1], expected)

"""#8 anchors: speculators' draw under the same seed, and its distributional rules."""

import pytest
import torch
from hypothesis import given

from conformance.checks import training
from conformance.strategies import FAST, MODEL, anchor_cases, training_cases
from conformance.tolerances import EXACT
from impl.interface import supports


@pytest.mark.quick
@pytest.mark.pitfall(8)
@pytest.mark.compare("select_anchors", references=("speculators",))
@FAST
@given(anchor_cases())
def test_anchor_draw_equals_speculators_p8(conform, pair, case):
    conform.describe(case)
    a, b = pair
    args = (case.loss_mask, case.max_anchors, case.block_size, case.seed)
    conform.compare((a.name, b.name), lambda: a.select_anchors(*args)[0],
                    lambda: b.select_anchors(*args)[0], EXACT, what="anchors under the same seed")
    conform.compare((a.name, b.name), lambda: a.select_anchors(*args)[1],
                    lambda: b.select_anchors(*args)[1], EXACT, what="anchor validity under the same seed")


@pytest.mark.quick
@pytest.mark.pitfall(8)
@FAST
@given(anchor_cases())
def test_anchor_distribution_rules_p8(conform, under_test, case):
    """Range, sortedness, the last block excluded, invalid slots zero; all anchors drawn where the mask allows."""
    conform.describe(case)
    names = (under_test.name, "rule")
    if not supports(under_test, "select_anchors"):  # an inference-only implementation draws no anchors
        conform.not_applicable(names, f"{under_test.name} has no select_anchors")
        return
    ok, drawn = conform.run(names, lambda: under_test.select_anchors(case.loss_mask, case.max_anchors,
                                                                      case.block_size, case.seed),
                            what="select_anchors")
    if not ok:
        return
    anchors, valid = drawn
    eligible = case.loss_mask[0].bool().clone()
    eligible[-case.block_size:] = False
    count = min(case.max_anchors, int(eligible.sum()))
    conform.compare(names, list(anchors.shape), [case.max_anchors], what="one slot per max_anchors")
    conform.compare(names, int(valid.sum()), count, what="valid anchors = min(max_anchors, eligible)")
    conform.compare(names, valid, torch.arange(case.max_anchors) < count, what="valid slots come first")
    drawn = anchors[valid]
    conform.compare(names, eligible[drawn], torch.ones_like(drawn, dtype=torch.bool),
                    what="anchors on loss-masked positions outside the last block")
    conform.compare(names, drawn, drawn.sort().values, what="anchors sorted")
    conform.compare(names, drawn.unique().numel(), drawn.numel(), what="drawn without replacement")
    conform.compare(names, anchors[~valid], torch.zeros_like(anchors[~valid]), what="invalid slots zero")


@pytest.mark.pitfall(8)
@pytest.mark.compare("training_outputs", references=("speculators",))
@MODEL
@given(training_cases())
def test_training_anchors_and_padded_blocks_p8(conform, pair, case):
    conform.describe(case)
    training.training_anchors(conform, *pair, case)

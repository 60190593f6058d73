"""#9 training mask vs speculators' `create_anchor_block_mask_mod`: full and sliding, causal or not within the
block, several documents, padding, anchors at the edges; then the same masks inside the training forward."""

import pytest
from hypothesis import given

from conformance.checks import masks, training
from conformance.strategies import FAST, MODEL, training_cases, training_mask_cases


@pytest.mark.quick
@pytest.mark.pitfall(9)
@pytest.mark.compare("training_mask", references=("speculators",))
@FAST
@given(training_mask_cases())
def test_training_mask_p9(conform, pair, case):
    conform.describe(case)
    masks.training_mask(conform, *pair, case)


@pytest.mark.pitfall(9)
@pytest.mark.compare("training_outputs", references=("speculators",))
@MODEL
@given(training_cases())
def test_training_forward_through_masks_p9(conform, pair, case):
    conform.describe(case)
    training.training_forward(conform, *pair, case)

"""#6 loss weights and reduction: gamma, slot 0, sample-from-anchor; sum(w*m*l) / (sum(m) + eps)."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from conformance.checks import losses
from conformance.strategies import FAST, MODEL, block_sizes, loss_cases

pytestmark = pytest.mark.quick


@pytest.mark.pitfall(6)
@pytest.mark.compare("loss_weights", references=("speculators",))
@FAST
@given(block_sizes, st.sampled_from([0.5, 1.0, 4.0, 7.0, 12.5]), st.booleans())
def test_loss_weight_schedule_p6(conform, pair, block_size, gamma, sample_from_anchor):
    conform.describe((block_size, gamma, sample_from_anchor))
    losses.loss_weights(conform, *pair, (block_size, gamma, sample_from_anchor))


@pytest.mark.pitfall(6)
def test_default_gamma_p6(conform, under_test):
    losses.recipe_defaults(conform, under_test, ("gamma", "max_anchors"))


@pytest.mark.pitfall(6)
@pytest.mark.compare("loss", references=("speculators",))
@MODEL
# Both kinds: the reduction is the same rule for each. B >= 2: with B = 1 a DFlash block trains no slot.
@given(loss_cases(min_block=2))
def test_loss_reduction_p6(conform, pair, case):
    conform.describe(case)
    losses.loss_value(conform, *pair, case)

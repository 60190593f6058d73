"""#7 loss kinds: KL to the target distribution (speculators' default) and CE on the target's argmax."""

import pytest
from hypothesis import given

from conformance.checks import losses
from conformance.strategies import MODEL, loss_cases

pytestmark = pytest.mark.quick


@pytest.mark.pitfall(7)
@pytest.mark.compare("loss", references=("speculators",))
@MODEL
# B >= 2: with B = 1 a DFlash block trains no slot.
@given(loss_cases(min_block=2, first_slot_only=True))
def test_loss_kinds_p7(conform, pair, case):
    conform.describe(case)
    losses.loss_value(conform, *pair, case)


@pytest.mark.pitfall(7)
def test_default_loss_fn_p7(conform, under_test):
    losses.recipe_defaults(conform, under_test, ("loss_fn",))

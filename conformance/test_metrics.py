"""#17 (training side) per-position accuracy and EAL against speculators' `compute_metrics`."""

import pytest
from hypothesis import given

from conformance.checks import losses
from conformance.strategies import MODEL, loss_cases

pytestmark = pytest.mark.quick


@pytest.mark.pitfall(17)
@pytest.mark.compare("block_metrics", references=("speculators",))
@MODEL
# B >= 2: with B = 1 a DFlash block drafts nothing (speculators refuses such a drafter).
@given(loss_cases(kinds=("kl_div",), min_block=2))
def test_position_accuracy_and_eal_p17(conform, pair, case):
    conform.describe(case)
    losses.block_metrics(conform, *pair, case)

"""#18 D-PACE per-position loss weights (speculators' trainer default for dflash): the weights
tensor by tensor against `dpace_loss_decay`, the weighted CE and its gradient against
`compute_metrics(per_position_loss_weight="dpace")`, and our trainer's default recipe against
speculators' TrainConfig resolution."""

import pytest
from hypothesis import given

from conformance.checks import losses
from conformance.strategies import FAST, MODEL, dpace_alphas, dpace_cases, loss_cases

pytestmark = pytest.mark.quick


@pytest.mark.pitfall(18)
@pytest.mark.compare("dpace_weights", references=("speculators",))
@FAST
@given(dpace_cases())
def test_dpace_weights_p18(conform, pair, case):
    conform.describe(case)
    losses.dpace_weights(conform, *pair, case)


@pytest.mark.pitfall(18)
@pytest.mark.compare("dpace_loss", references=("speculators",))
@MODEL
# B >= 2: with B = 1 every slot is an anchor and nothing is trained.
@given(loss_cases(kinds=("ce",), min_block=2), dpace_alphas)
def test_dpace_loss_and_gradient_p18(conform, pair, case, alpha):
    conform.describe((case, alpha))
    losses.dpace_loss(conform, *pair, case, alpha)


@pytest.mark.pitfall(18)
def test_default_loss_weighting_p18(conform, under_test):
    losses.recipe_defaults(conform, under_test, ("per_position_loss_weight", "dpace_alpha"))

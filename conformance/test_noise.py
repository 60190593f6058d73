"""#15 noise: hidden-state noise reaches the drafter's inputs only; targets stay clean."""

import pytest
from hypothesis import given

from conformance.checks import training
from conformance.strategies import MODEL, training_cases


@pytest.mark.quick
@pytest.mark.pitfall(15)
@pytest.mark.compare("training_outputs", references=("speculators",))
@MODEL
@given(training_cases())
def test_noise_never_reaches_targets_p15(conform, pair, case):
    conform.describe(case)
    training.noise_stays_out_of_targets(conform, *pair, case)

"""#5 target alignment: slot k >= 1 at a + k is trained toward the logits at a + k - 1."""

import pytest
from hypothesis import given

from conformance.checks import training
from conformance.strategies import MODEL, training_cases


@pytest.mark.pitfall(5)
@pytest.mark.compare("training_outputs", references=("speculators",))
@MODEL
@given(training_cases())
def test_target_alignment_p5(conform, pair, case):
    conform.describe(case)
    training.target_alignment(conform, *pair, case)

"""#3 targets: the verifier's final layer, normalised exactly once."""

import pytest
from hypothesis import given

from conformance.checks import training
from conformance.strategies import MODEL, training_cases


@pytest.mark.pitfall(3)
@pytest.mark.compare("training_outputs", references=("speculators",))
@MODEL
@given(training_cases())
def test_targets_are_final_layer_logits_normalised_once_p3(conform, pair, case):
    conform.describe(case)
    training.targets_source(conform, *pair, case)

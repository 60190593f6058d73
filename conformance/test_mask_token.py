"""#14 mask token: the spec's id fills the block in training (compared through the training forward, on one
document with full attention: packing and windows are #9's)."""

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st

from conformance.checks import training
from conformance.strategies import MODEL, training_cases


@pytest.mark.pitfall(14)
@pytest.mark.compare("training_outputs", references=("speculators",))
@MODEL
@given(training_cases(sliding=False, single_document=True), st.integers(0, 95))
def test_mask_token_in_training_p14(conform, pair, case, mask_token_id):
    case = dataclasses.replace(case, spec=case.spec.replace(mask_token_id=mask_token_id))
    conform.describe(case)
    training.training_forward(conform, *pair, case)

"""#24 DFlash2's selector training: candidates with the missing target swapped in, labels, the
K-way loss with its per-slot weights, and the teacher-forced predecessors of a training forward."""

import pytest
from hypothesis import given

from conformance.checks import dflash2
from conformance.strategies import FAST, MODEL, dflash2_training_cases, selector_loss_cases


@pytest.mark.quick
@pytest.mark.pitfall(24)
@pytest.mark.compare("selector_training_candidates", references=("speculators",))
@FAST
@given(selector_loss_cases())
def test_selector_training_candidates_p24(conform, pair, case):
    conform.describe(case)
    dflash2.training_candidates(conform, *pair, case)


@pytest.mark.quick
@pytest.mark.pitfall(24)
@pytest.mark.compare("selector_loss", references=("speculators",))
@FAST
@given(selector_loss_cases())
def test_selector_loss_p24(conform, pair, case):
    conform.describe(case)
    dflash2.selector_loss(conform, *pair, case)


@pytest.mark.pitfall(24)
@pytest.mark.compare("training_outputs", references=("speculators",))
@MODEL
@given(dflash2_training_cases())
def test_selector_training_forward_p24(conform, pair, case):
    conform.describe(case)
    dflash2.selector_training(conform, *pair, case)

"""#37 DSpark's loss (loss_fn's terms on the Markov-corrected logits, the confidence BCE toward 1 - TV weighted by
confidence_head_alpha) and #38 XPress's (teacher-forced, consistency rounds, base anchor, ce from data), term by
term and in total, against speculators' own `DSparkDraftModel.forward` / `XPressDraftModel.forward`."""

import pytest
from hypothesis import given, settings

from conformance.checks import family_losses
from conformance.strategies import dspark_specs, family_loss_cases, xpress_specs

FAMILY_LOSS = settings(max_examples=4)  # each example builds both drafters and runs a whole training forward


@pytest.mark.quick
@pytest.mark.pitfall(37)
@pytest.mark.compare("family_loss", references=("speculators",))
@FAMILY_LOSS
@given(family_loss_cases(dspark_specs()))
def test_dspark_loss_terms_p37(conform, pair, case):
    conform.describe(case)
    family_losses.loss_terms(conform, *pair, case)


@pytest.mark.quick
@pytest.mark.pitfall(38)
@pytest.mark.compare("family_loss", references=("speculators",))
@FAMILY_LOSS
@given(family_loss_cases(xpress_specs()))
def test_xpress_loss_terms_p38(conform, pair, case):
    conform.describe(case)
    family_losses.loss_terms(conform, *pair, case)

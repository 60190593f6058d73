"""#37 DSpark's heads: the Markov bias and the confidence logits of teacher-forced blocks, and the block drafted
left to right through the Markov chain, against speculators' own `DSparkDraftModel` modules."""

import pytest
from hypothesis import given

from conformance.checks import family_heads
from conformance.strategies import MODEL, dspark_specs, head_cases


@pytest.mark.quick
@pytest.mark.pitfall(37)
@pytest.mark.compare("markov_bias", references=("speculators",))
@MODEL
@given(head_cases(dspark_specs()))
def test_markov_and_confidence_heads_p37(conform, pair, case):
    conform.describe(case)
    family_heads.head_forward(conform, *pair, case, ("markov_bias", "confidence_logits"))


@pytest.mark.quick
@pytest.mark.pitfall(37)
@pytest.mark.compare("markov_path", references=("speculators",))
@MODEL
@given(head_cases(dspark_specs()))
def test_markov_chain_drafts_left_to_right_p37(conform, pair, case):
    conform.describe(case)
    family_heads.decoding_round(conform, *pair, case, "markov_path")

"""#32 reduced draft vocabulary: the d2t/t2d mapping from token frequencies, training targets and logits over
the draft vocabulary (the verifier head's mapped rows), and the target ids proposed through the head and d2t.
z-lab's own package has no draft vocabulary: n/a there (its adapter declares the operations unsupported)."""

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st

from conformance.checks import draft_vocab
from conformance.strategies import MODEL, training_cases
from conformance.world import VOCAB


@st.composite
def reduced_cases(draw, single_document: bool = False):
    case = draw(training_cases(single_document=single_document))
    size = draw(st.integers(2, VOCAB - 1))
    return dataclasses.replace(case, spec=case.spec.replace(draft_vocab_size=size))


@pytest.mark.quick
@pytest.mark.pitfall(32)
@pytest.mark.compare("vocab_mapping", references=("speculators", "zlab"))
@MODEL
@given(reduced_cases())
def test_mapping_from_token_frequencies_p32(conform, pair, case):
    conform.describe(case)
    draft_vocab.mapping_construction(conform, *pair, case)


@pytest.mark.pitfall(32)
@pytest.mark.compare("training_outputs", references=("speculators",))
@MODEL
@given(reduced_cases(single_document=True))
def test_targets_and_logits_over_the_draft_vocabulary_p32(conform, pair, case):
    conform.describe(case)
    draft_vocab.restricted_training(conform, *pair, case)


@pytest.mark.quick
@pytest.mark.pitfall(32)
@pytest.mark.compare("proposed_ids", references=("speculators", "zlab"))
@MODEL
@given(reduced_cases())
def test_proposed_ids_through_the_draft_head_and_d2t_p32(conform, pair, case):
    conform.describe(case)
    draft_vocab.proposals(conform, *pair, case)

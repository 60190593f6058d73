"""#13 embeddings / head: the drafter borrows the target's input embeddings and LM head (one document, full
attention: packing and windows are #9's)."""

import pytest
from hypothesis import given

from conformance.checks import training
from conformance.strategies import MODEL, training_cases
from conformance.tolerances import EXACT
from conformance.world import reference_state_dict, target_for


@pytest.mark.pitfall(13)
@pytest.mark.compare("training_outputs", references=("speculators",))
@MODEL
@given(training_cases(sliding=False, single_document=True))
def test_borrowed_embeddings_and_head_p13(conform, pair, case):
    conform.describe(case)
    training.training_forward(conform, *pair, case)


@pytest.mark.quick
@pytest.mark.pitfall(13)
@MODEL
@given(training_cases())
def test_speculators_verifier_owned_tensors_are_the_targets_p13(conform, speculators, case):
    """speculators stores embed_tokens / lm_head / verifier_lm_head / verifier_norm: copies of the verifier's."""
    conform.describe(case)
    target = target_for(case.spec)
    drafter = speculators.build_drafter(case.spec, reference_state_dict(case.spec), target)
    owned = {"embed_tokens": target.get_input_embeddings().weight, "lm_head": target.lm_head.weight,
             "verifier_lm_head": target.lm_head.weight, "verifier_norm": target.model.norm.weight}
    for name, expected in owned.items():
        conform.compare(("speculators", "transformers"), getattr(drafter, name).weight,
                        expected.detach(), EXACT, what=f"verifier-owned {name}")

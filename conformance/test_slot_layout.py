"""#33 slot layout (`sample_from_anchor`): ours held to speculators on both layouts: the speculative-token count
speculators writes, the slots whose logits propose at decoding time, and the targets, loss mask and loss
weights of a training forward under the drafter's layout (speculators' own `DFlashDraftModel` built with
that `sample_from_anchor`). z-lab's dflash has no such setting: n/a there (its adapter declares it)."""

import dataclasses

import pytest

from conformance.checks import dflash2, slot_layout
from conformance.planted import DFLASH2_TRAINING, SLOT, SPEC, TRAINING

pytestmark = [pytest.mark.quick, pytest.mark.pitfall(33)]
LAYOUTS = pytest.mark.parametrize("sample_from_anchor", [False, True], ids=["anchor-as-bonus", "sample-from-anchor"])


@pytest.mark.compare("speculative_tokens", references=("speculators",))
@LAYOUTS
def test_speculative_tokens_p33(conform, pair, sample_from_anchor):
    for block_size in (2, 4, 8, 16):
        conform.describe({"block_size": block_size, "sample_from_anchor": sample_from_anchor})
        slot_layout.speculative_tokens(conform, *pair, block_size, sample_from_anchor)


@pytest.mark.compare("proposal_logits", references=("speculators",))
@LAYOUTS
def test_proposals_per_slot_p33(conform, pair, sample_from_anchor):
    case = dataclasses.replace(SLOT, spec=SLOT.spec.replace(sample_from_anchor=sample_from_anchor))
    conform.describe(case)
    slot_layout.proposals(conform, *pair, case)


@pytest.mark.compare("training_outputs", references=("speculators",))
@LAYOUTS
def test_training_follows_the_drafter_layout_p33(conform, pair, sample_from_anchor):
    case = dataclasses.replace(TRAINING, spec=SPEC.replace(sample_from_anchor=sample_from_anchor))
    conform.describe(case)
    slot_layout.trained_layout(conform, *pair, case)


@pytest.mark.compare("training_outputs", references=("speculators",))
def test_dflash2_selector_predecessors_under_sample_from_anchor_p33(conform, pair):
    """Sampling from the anchor, slot k proposes the token after position a + k, so the selector's teacher-forced
    predecessor is the token AT a + k (speculators' `_predecessor_ids` under its config's layout)."""
    case = dataclasses.replace(DFLASH2_TRAINING, spec=DFLASH2_TRAINING.spec.replace(
                                                                          sample_from_anchor=True))
    conform.describe(case)
    dflash2.selector_training(conform, *pair, case)

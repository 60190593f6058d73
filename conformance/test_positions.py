"""#12 positions: block slots continue the context's positions (a .. a+B-1), in training and at inference.

Drawn with full attention (and one document in training): windows and packing are #9's and #11's."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from conformance.checks import forward, training
from conformance.checks.forward import ForwardCase
from conformance.strategies import MODEL, draft_specs, training_cases


@pytest.mark.pitfall(12)
@pytest.mark.compare("draft_forward", references=("zlab",))
@MODEL
@given(draft_specs(max_layers=2, sliding=False), st.integers(1, 8), st.integers(1, 200), st.integers(0, 2**16))
def test_inference_positions_continue_context_p12(conform, pair, spec, context_len, offset, seed):
    import torch
    case = ForwardCase(spec, context_len, offset, torch.float32, seed)
    conform.describe(case)
    forward.draft_forward(conform, *pair, case)


@pytest.mark.pitfall(12)
@pytest.mark.compare("training_outputs", references=("speculators",))
@MODEL
@given(training_cases(sliding=False, single_document=True))
def test_training_positions_p12(conform, pair, case):
    conform.describe(case)
    training.training_forward(conform, *pair, case)

"""#10 inference mask vs z-lab's `_attention_mask`, the draft forward in the inference layout, and what a
block sees at inference compared with what it saw in training (the two references' layouts)."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from conformance.checks import forward, masks
from conformance.checks.forward import ForwardCase
from conformance.strategies import FAST, MODEL, draft_specs, dtypes, inference_mask_cases


@pytest.mark.quick
@pytest.mark.pitfall(10)
@pytest.mark.compare("inference_mask", references=("zlab",))
@FAST
@given(inference_mask_cases())
def test_inference_mask_p10(conform, pair, case):
    conform.describe(case)
    masks.inference_mask(conform, *pair, case)


# (context, block, window): full attention, a window larger than context + block, one smaller.
LAYOUT_CASES = [(6, 4, None), (12, 8, None), (5, 4, 16), (10, 4, 4), (12, 8, 6), (3, 4, 2)]


@pytest.mark.quick
@pytest.mark.pitfall(10)
@pytest.mark.parametrize("case", LAYOUT_CASES, ids=[f"ctx{c}-B{b}-W{w}" for c, b, w in LAYOUT_CASES])
def test_training_layout_vs_inference_layout_p10(conform, speculators, zlab, case):
    """Reference vs reference: differences here are findings about the references, recorded as such."""
    conform.describe(case)
    masks.training_vs_inference(conform, speculators, zlab, case)


@pytest.mark.quick
@pytest.mark.pitfall(10)
@pytest.mark.compare("draft_forward", cross=True)
@MODEL
@given(draft_specs(sliding=False), st.integers(1, 12), dtypes, st.integers(0, 2**16))
def test_draft_forward_identical_weights_full_attention_p10(conform, pair, spec, context_len, dtype, seed):
    case = ForwardCase(spec, context_len, 0, dtype, seed)
    conform.describe(case)
    forward.draft_forward(conform, *pair, case)

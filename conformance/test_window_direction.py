"""#25 Bidirectional sliding windows (speculators' `sliding_window_non_causal`, DFlash2's default;
z-lab's `is_causal: false`): a sliding layer sees its whole block, and the window still bounds
the context, in training, at inference and in a drafter's forward."""

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st

from conformance.checks import forward, masks
from conformance.checks.forward import ForwardCase
from conformance.strategies import FAST, MODEL, draft_specs, dtypes, inference_mask_cases, training_mask_cases

bidirectional_training_masks = training_mask_cases(sliding=True).map(
    lambda case: dataclasses.replace(case, causal_block=False))
bidirectional_inference_masks = inference_mask_cases().filter(lambda case: case.sliding_window is not None).map(
    lambda case: dataclasses.replace(case, causal=False))


@pytest.mark.quick
@pytest.mark.pitfall(25)
@pytest.mark.compare("training_mask", references=("speculators",))
@FAST
@given(bidirectional_training_masks)
def test_bidirectional_window_training_mask_p25(conform, pair, case):
    conform.describe(case)
    masks.training_mask(conform, *pair, case)


@pytest.mark.quick
@pytest.mark.pitfall(25)
@pytest.mark.compare("inference_mask", references=("zlab",))
@FAST
@given(bidirectional_inference_masks)
def test_bidirectional_window_inference_mask_p25(conform, pair, case):
    conform.describe(case)
    masks.inference_mask(conform, *pair, case)


LAYOUT_CASES = [(5, 4, 16), (10, 4, 4), (12, 8, 6), (3, 4, 2)]


@pytest.mark.quick
@pytest.mark.pitfall(25)
@pytest.mark.parametrize("case", LAYOUT_CASES, ids=[f"ctx{c}-B{b}-W{w}" for c, b, w in LAYOUT_CASES])
def test_bidirectional_window_training_layout_vs_inference_layout_p25(conform, speculators, zlab, case):
    """Reference vs reference (a difference would be a finding about the references): the whole block,
    in both layouts. How far back the window reaches into the context is #10's layout check."""
    conform.describe(case)
    masks.block_direction_training_vs_inference(conform, speculators, zlab, case)


@pytest.mark.pitfall(25)
@pytest.mark.compare("draft_forward", references=("zlab",))
@MODEL
@given(draft_specs(sliding=True), st.integers(1, 12), dtypes, st.integers(0, 2**16))
def test_bidirectional_window_draft_forward_p25(conform, pair, spec, context_len, dtype, seed):
    """A DFlash drafter with bidirectional sliding blocks, in the inference layout."""
    case = ForwardCase(spec.replace(sliding_window_non_causal=True), context_len, 0, dtype, seed)
    conform.describe(case)
    forward.draft_forward(conform, *pair, case)

"""#35 rotary: theta, transformers' rope scalings, partial rotary and the interleaved style, held to the
references' rotary (full neox rotary: z-lab and speculators; partial and interleaved: n/a there, see
conformance/checks/rotary.py) and to transformers' partial-rotary (Qwen3-Next) and interleaved (GPT-J)
implementations; and a scaled rotary in the whole draft forward."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from conformance.checks import forward, rotary
from conformance.checks.forward import ForwardCase
from conformance.strategies import MODEL, rotary_cases, rotary_specs


@pytest.mark.pitfall(35)
@pytest.mark.compare("apply_rotary", references=("zlab", "speculators"), cross=True)
@MODEL
@given(rotary_cases())
def test_rotary_matches_the_references_p35(conform, pair, case):
    conform.describe(case)
    rotary.rotary(conform, *pair, case)


@pytest.mark.pitfall(35)
@MODEL
@given(rotary_cases(partial=True, interleaved=None))
def test_partial_and_interleaved_rotary_match_transformers_p35(conform, under_test, case):
    conform.describe(case)
    rotary.against_transformers(conform, under_test, case)


@pytest.mark.pitfall(35)
@pytest.mark.compare("draft_forward", references=("zlab",))
@MODEL
@given(rotary_specs(partial=False), st.integers(1, 8), st.integers(0, 200), st.integers(0, 2**16))
def test_scaled_rotary_forward_p35(conform, pair, spec, context_len, offset, seed):
    import torch
    case = ForwardCase(spec, context_len, offset, torch.float32, seed)
    conform.describe(case)
    forward.draft_forward(conform, *pair, case)

"""#11 layer types: sliding layers stay sliding, visible once the context outgrows the window."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from conformance.checks import forward
from conformance.checks.forward import ForwardCase
from conformance.strategies import MODEL, draft_specs, dtypes


@pytest.mark.pitfall(11)
@pytest.mark.compare("draft_forward", references=("zlab",), cross=True)
@MODEL
@given(draft_specs(sliding=True), st.integers(1, 30), dtypes, st.integers(0, 2**16))
def test_sliding_and_full_layers_p11(conform, pair, spec, context_len, dtype, seed):
    case = ForwardCase(spec, context_len, 0, dtype, seed)
    conform.describe(case)
    forward.draft_forward(conform, *pair, case)

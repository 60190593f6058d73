"""#38 XPress's refiner: its biases on teacher-forced blocks, and a block resolved by the drafter's Jacobi
passes, against speculators' own `XPressDraftModel` modules."""

import pytest
from hypothesis import given

from conformance.checks import family_heads
from conformance.strategies import MODEL, head_cases, xpress_specs


@pytest.mark.quick
@pytest.mark.pitfall(38)
@pytest.mark.compare("refiner_bias", references=("speculators",))
@MODEL
@given(head_cases(xpress_specs()))
def test_refiner_bias_p38(conform, pair, case):
    conform.describe(case)
    family_heads.head_forward(conform, *pair, case, ("refiner_bias",))


@pytest.mark.quick
@pytest.mark.pitfall(38)
@pytest.mark.compare("jacobi_tokens", references=("speculators",))
@MODEL
@given(head_cases(xpress_specs()))
def test_jacobi_resolution_p38(conform, pair, case):
    conform.describe(case)
    family_heads.decoding_round(conform, *pair, case, "jacobi_tokens")

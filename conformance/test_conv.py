"""#22 DFlash2's grouped dynamic causal convolution: its taps, the group layout and the block
boundaries, then the whole DFlash2 draft forward with identical weights."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from conformance.checks import dflash2, forward
from conformance.checks.forward import ForwardCase
from conformance.strategies import MODEL, conv_cases, dflash2_dtypes, dflash2_specs


@pytest.mark.quick
@pytest.mark.pitfall(22)
@pytest.mark.compare("dynamic_conv", cross=True)
@MODEL
@given(conv_cases())
def test_conv_taps_and_group_layout_p22(conform, pair, case):
    conform.describe(case)
    dflash2.conv_taps(conform, *pair, case)


@pytest.mark.quick
@pytest.mark.pitfall(22)
@pytest.mark.compare("draft_forward", references=("zlab",))
@MODEL
@given(dflash2_specs(), st.integers(1, 12), dflash2_dtypes, st.integers(0, 2**16))
def test_dflash2_draft_forward_identical_weights_p22(conform, pair, spec, context_len, dtype, seed):
    """Convolutions inside every layer, sliding layers bidirectional or causal: the inference layout."""
    case = ForwardCase(spec, context_len, 0, dtype, seed)
    conform.describe(case)
    forward.draft_forward(conform, *pair, case)


@pytest.mark.pitfall(22)
@pytest.mark.compare("draft_forward", cross=True)
@MODEL
@given(dflash2_specs(sliding=False), st.integers(1, 12), st.integers(0, 2**16))
def test_dflash2_draft_forward_full_attention_all_three_p22(conform, pair, spec, context_len, seed):
    """Full attention only: speculators lays a block out as in training, the same keys as z-lab's then.
    fp32 only: speculators' eager attention takes its softmax in fp32 whatever the dtype."""
    case = ForwardCase(spec, context_len, 0, torch.float32, seed)
    conform.describe(case)
    forward.draft_forward(conform, *pair, case)

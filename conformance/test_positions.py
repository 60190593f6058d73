"""#12 positions: block slots continue the context's positions (a .. a+B-1), in training and at inference.

Drawn with full attention (and one document in training): windows and packing are #9's and #11's. Partial
rotary: neither reference runs it (n/a there, with the adapters' reason)."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from conformance.checks import forward, training
from conformance.checks.forward import ForwardCase
from conformance.strategies import MODEL, TrainingCase, draft_specs, training_cases
from conformance.world import VOCAB
from impl.spec import DraftSpec

# A tiny full-attention drafter for the partial-rotary cases.
PARTIAL_SPEC = DraftSpec(hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1,
                         head_dim=16, num_hidden_layers=2, target_vocab_size=VOCAB, target_layer_ids=(0, 2),
                         num_target_layers=4, mask_token_id=VOCAB - 1, block_size=4)


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


@pytest.mark.pitfall(12)
@pytest.mark.compare("draft_forward", references=("zlab",))
def test_inference_positions_with_partial_rotary_p12(conform, pair):
    """Half of each head rotated, from a later position: n/a at z-lab, whose rotary cannot run it
    (`reference_adapters/zlab_adapter.py` says why); ours is held to transformers' partial rotary at such
    positions in conformance/test_rotary.py."""
    import dataclasses

    import torch
    spec = dataclasses.replace(PARTIAL_SPEC, partial_rotary_factor=0.5)
    forward.draft_forward(conform, *pair, ForwardCase(spec, 5, 40, torch.float32, 0))


@pytest.mark.pitfall(12)
@pytest.mark.compare("training_outputs", references=("speculators",))
def test_training_positions_with_partial_rotary_p12(conform, pair):
    """The same in the training layout: n/a at speculators (`reference_adapters/speculators_adapter.py`)."""
    import dataclasses

    case = TrainingCase(dataclasses.replace(PARTIAL_SPEC, partial_rotary_factor=0.5), (12,), 1, 3, 0)
    training.training_forward(conform, *pair, case)

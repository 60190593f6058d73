import pytest
import torch

from impl.extract import HiddenStateExtractor, final_norm
from tests.helpers import tiny_target


@pytest.fixture(scope="module")
def target():
    return tiny_target(num_layers=6)


def test_context_features_use_zlab_indexing(target):
    ids = torch.randint(0, 128, (1, 11))
    states = HiddenStateExtractor(target, [0, 2, 4])(ids)
    hs = target(ids, output_hidden_states=True).hidden_states
    assert states.context.shape == (1, 11, 3 * 64)
    torch.testing.assert_close(states.context, torch.cat([hs[1], hs[3], hs[5]], -1), rtol=0, atol=0)


def test_final_state_is_raw_last_layer_output_and_hs_last_is_post_norm(target):
    ids = torch.randint(0, 128, (1, 9))
    states = HiddenStateExtractor(target, [1])(ids)
    # Recompute the last layer's raw output by hand from hs[-2] (its input).
    captured = {}
    handle = target.model.layers[-1].register_forward_hook(lambda m, i, o: captured.setdefault("raw", o))
    hs = target(ids, output_hidden_states=True).hidden_states
    handle.remove()
    raw = captured["raw"][0] if isinstance(captured["raw"], tuple) else captured["raw"]
    torch.testing.assert_close(states.final_raw, raw, rtol=0, atol=0)
    # transformers 5.x: hs[-1] is already normalised ...
    torch.testing.assert_close(hs[-1], final_norm(target)(states.final_raw), rtol=0, atol=0)
    # ... so it differs from the raw state, and normalising it again changes it once more.
    assert not torch.allclose(hs[-1], states.final_raw, atol=1e-3)
    assert not torch.allclose(final_norm(target)(hs[-1]), hs[-1], atol=1e-4)


def test_source_layer_selects_an_intermediate_raw_state(target):
    ids = torch.randint(0, 128, (1, 7))
    states = HiddenStateExtractor(target, [1], source_layer=3)(ids)
    hs = target(ids, output_hidden_states=True).hidden_states
    torch.testing.assert_close(states.source, hs[4], rtol=0, atol=0)


def test_logits_are_the_targets_own(target):
    ids = torch.randint(0, 128, (1, 7))
    states = HiddenStateExtractor(target, [1])(ids, with_logits=True)
    torch.testing.assert_close(states.logits, target(ids).logits)


def test_out_of_range_layer_is_an_error(target):
    with pytest.raises(ValueError, match=r"\[6\] outside"):
        HiddenStateExtractor(target, [1, 6])

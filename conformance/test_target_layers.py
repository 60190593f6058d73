"""#1 target-layer selection and #2 the hidden-state index convention (incl. speculators' converter)."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from conformance.checks import layers
from conformance.strategies import FAST

pytestmark = pytest.mark.quick


@pytest.mark.pitfall(1)
@pytest.mark.compare("default_target_layer_ids", references=("zlab",), cross=True)
@FAST
@given(st.integers(4, 128), st.integers(1, 8))
def test_default_layer_selection_p1(conform, pair, num_target_layers, num_draft_layers):
    conform.describe((num_target_layers, num_draft_layers))
    layers.default_layer_ids(conform, *pair, (num_target_layers, num_draft_layers))


@pytest.mark.pitfall(2)
@pytest.mark.compare("context_features", cross=True)
@FAST
@given(st.data())
def test_hidden_state_index_convention_p2(conform, pair, data):
    num_target_layers = data.draw(st.integers(3, 7))
    ids = data.draw(st.lists(st.integers(0, num_target_layers - 1), min_size=1, max_size=6, unique=True))
    case = (num_target_layers, data.draw(st.sampled_from([32, 64])), ids)
    conform.describe(case)
    layers.context_feature_indexing(conform, *pair, case)


@pytest.mark.pitfall(2)
@FAST
@given(st.data())
def test_speculators_converter_convention_p2(conform, under_test, data):
    num_target_layers = data.draw(st.integers(3, 7))
    ids = data.draw(st.lists(st.integers(0, num_target_layers - 2), min_size=1, max_size=4, unique=True))
    ids += data.draw(st.sampled_from([[], [num_target_layers - 1]]))  # an id naming the final layer is dropped
    conform.describe((num_target_layers, ids))
    aux = layers.converter_convention(conform, (num_target_layers, ids))
    if under_test.name == "ours":  # our own translation of the convention, used by our converter
        from impl.layers import zlab_to_speculators
        conform.compare(("ours", "speculators"), zlab_to_speculators(ids, num_target_layers),
                        aux, what="z-lab -> speculators layer ids vs speculators' converter")

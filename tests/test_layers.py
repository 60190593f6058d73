from dflash.model import build_target_layer_ids as zlab_build_target_layer_ids
from hypothesis import given
from hypothesis import strategies as st

from impl.layers import build_target_layer_ids, speculators_to_zlab, zlab_to_speculators


def test_zlab_default_for_a_64_layer_target():
    assert build_target_layer_ids(64, 5) == [1, 16, 31, 46, 61]
    assert build_target_layer_ids(36, 1) == [18]


@given(st.integers(4, 128), st.integers(1, 8))
def test_default_selection_equals_zlab_package(num_target, num_draft):
    assert build_target_layer_ids(num_target, num_draft) == zlab_build_target_layer_ids(num_target, num_draft)


def test_convention_converters():
    assert zlab_to_speculators([1, 16, 31, 46, 61], 64) == [2, 17, 32, 47, 62]
    assert speculators_to_zlab([2, 17, 32, 47, 62]) == [1, 16, 31, 46, 61]
    # the id naming the final layer is dropped, as speculators' converter does
    assert zlab_to_speculators([1, 3, 5], 6) == [2, 4]

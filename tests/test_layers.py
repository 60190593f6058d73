"""Layer-id rules on their own; their parity with z-lab and speculators lives in
`conformance/test_target_layers.py` (#1, #2)."""

from impl.layers import build_target_layer_ids, speculators_to_zlab, zlab_to_speculators


def test_zlab_default_for_a_64_layer_target():
    assert build_target_layer_ids(64, 5) == [1, 16, 31, 46, 61]
    assert build_target_layer_ids(36, 1) == [18]


def test_convention_converters():
    assert zlab_to_speculators([1, 16, 31, 46, 61], 64) == [2, 17, 32, 47, 62]
    assert speculators_to_zlab([2, 17, 32, 47, 62]) == [1, 16, 31, 46, 61]
    # the id naming the final layer is dropped, as speculators' converter does
    assert zlab_to_speculators([1, 3, 5], 6) == [2, 4]

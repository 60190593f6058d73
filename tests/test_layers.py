"""Layer-id rules on their own; their parity with z-lab and speculators lives in
`conformance/test_target_layers.py` (#1, #2)."""

import pytest

from dflash_audit.formats.setting_names import DeclarationError, convert
from impl.layers import (
    build_target_layer_ids,
    hidden_state_index,
    names_final_layer,
    speculators_to_zlab,
    zlab_to_speculators,
)


def test_zlab_default_for_a_64_layer_target():
    assert build_target_layer_ids(64, 5) == [1, 16, 31, 46, 61]
    assert build_target_layer_ids(36, 1) == [18]


def test_convention_converters():
    assert zlab_to_speculators([1, 16, 31, 46, 61], 64) == [2, 17, 32, 47, 62]
    assert speculators_to_zlab([2, 17, 32, 47, 62]) == [1, 16, 31, 46, 61]
    # the id naming the final layer is dropped, as speculators' converter does
    assert zlab_to_speculators([1, 3, 5], 6) == [2, 4]


def test_hidden_state_index_and_final_layer():
    assert [hidden_state_index(i) for i in [0, 5]] == [1, 6]  # hidden_states[0] is the embedding output
    assert names_final_layer(5, 6) and not names_final_layer(4, 6)


def test_speculators_ids_below_one_are_refused_wherever_they_are_read():
    with pytest.raises(ValueError, match="start at 1"):
        speculators_to_zlab([0, 2])
    # A declared speculators TrainConfig goes through the same check.
    assert convert("target_layer_ids", [2, 4], "args.json", speculators_ids=True) == [1, 3]
    with pytest.raises(DeclarationError, match="args.json: speculators aux ids start at 1"):
        convert("target_layer_ids", [0, 2], "args.json", speculators_ids=True)

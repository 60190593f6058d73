"""The conformance comparator: unsupported cases are n/a with their reason, None values are compared."""

from __future__ import annotations

import pytest
import torch

from conformance.comparator import Comparator, Divergence
from impl.interface import TrainingOutputs, Unsupported

pytestmark = pytest.mark.quick


def comparator():
    outcomes = []
    cmp = Comparator(lambda status, entry, key: outcomes.append((status, entry, key)), "t", frozenset({"ref"}), 9)
    return cmp, outcomes


def unsupported():
    raise Unsupported("cannot express a causal full-attention block")


def test_an_unsupported_case_is_na_with_its_reason():
    cmp, outcomes = comparator()
    assert cmp.compare(("impl", "ref"), unsupported, torch.ones(2), what="mask") is None
    [(status, entry, key)] = outcomes
    assert status == "n/a" and entry is None and "causal full-attention" in key["reason"]


def test_none_is_compared_as_a_value():
    cmp, outcomes = comparator()
    with pytest.raises(Divergence, match="None != 4.0"):
        cmp.compare(("impl", "ref"), None, 4.0, what="default gamma")
    assert outcomes[0][0] == "fail"
    cmp.compare(("impl", "ref"), None, None)
    assert outcomes[1][0] == "pass"


def test_run_gives_the_value_na_or_the_divergence():
    cmp, outcomes = comparator()
    assert cmp.run(("impl", "ref"), lambda: 3) == (True, 3)
    assert cmp.run(("impl", "ref"), unsupported) == (False, None) and outcomes[-1][0] == "n/a"
    with pytest.raises(Divergence, match="ValueError: no anchors"):
        cmp.run(("impl", "ref"), lambda: (_ for _ in ()).throw(ValueError("no anchors")))
    assert outcomes[-1][0] == "fail"


def test_a_field_an_implementation_has_none_of_is_unsupported():
    out = TrainingOutputs(anchors=torch.zeros(1), anchor_valid=torch.ones(1, dtype=torch.bool), logits=torch.zeros(1),
                          targets=None, loss_mask=torch.zeros(1), target_ids=torch.zeros(1),
                          unsupported={"targets": "hard labels"})
    with pytest.raises(Unsupported, match="hard labels"):
        out.get("targets")
    assert out.get("target_ids") is out.target_ids

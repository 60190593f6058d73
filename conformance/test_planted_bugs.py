"""Planted-bug self-test: every bug class in `planted.BUGS` must make its component check fail (and the
unmutated implementation must pass the same check). Results feed the report's detection table."""


import pytest
import torch

import impl.masks
from conformance import planted
from conformance.checks import forward
from conformance.checks.forward import ForwardCase
from conformance.comparator import Comparator, Divergence
from conformance.conftest import REFERENCE_NAMES
from conformance.planted import BUGS, SPEC
from impl.model import DFlashDrafter

pytestmark = pytest.mark.quick


def _quiet_comparator(test: str, pitfall: int) -> Comparator:
    """Planted runs must not pollute the component table: their outcomes go to the planted table only."""
    return Comparator(lambda *_: None, test, REFERENCE_NAMES, pitfall)


@pytest.mark.parametrize("bug", BUGS, ids=[bug.name for bug in BUGS])
def test_planted_bug_is_caught(bug, under_test, speculators, zlab, recorder, monkeypatch, request):
    if under_test.name != "ours":
        pytest.skip("planted bugs mutate impl/: they apply to ours only")
    references = {"speculators": speculators, "zlab": zlab}
    bug.check(_quiet_comparator(request.node.nodeid, bug.pitfall), under_test, references)  # clean: must pass

    mutated = bug.plant(monkeypatch, under_test.wrapped)  # ours itself, not seen through the plug boundary
    entry = None
    try:
        bug.check(_quiet_comparator(request.node.nodeid, bug.pitfall), mutated, references)
    except Divergence as divergence:
        entry = divergence.entry
    recorder.add_planted(bug.name, bug.component, bug.pitfall, caught=entry is not None, diff=entry)
    assert entry is not None, f"planted bug {bug.name!r} was not caught by the {bug.component} check"
    assert entry.component == bug.component, f"caught, but reported under {entry.component!r}"


# The one draft-forward check, in each entry's form: #10 the plain forward, #12 a later position, #11 a
# sliding layer, #25 bidirectional sliding blocks, #22 DFlash2's convolutions (on full attention), #35 a scaled
# rotary at a later position.
FULL = SPEC.replace(layer_types=("full_attention",) * SPEC.num_hidden_layers, sliding_window=None)
FORWARD_CASES = {
    10: ForwardCase(FULL, 6, 0, torch.float32, 1),
    12: ForwardCase(FULL, 6, 9, torch.float32, 1),
    11: ForwardCase(SPEC, 8, 0, torch.float32, 1),
    25: ForwardCase(SPEC.replace(sliding_window_non_causal=True), 8, 0, torch.float32, 1),
    22: ForwardCase(FULL.replace(conv_kernel_size=3, conv_group_size=8, selector_rank=8,
                                        selector_top_k=5), 6, 0, torch.float32, 1),
    35: ForwardCase(FULL.replace(rope_scaling={"rope_type": "linear", "factor": 2.0}), 6, 9,
                    torch.float32, 1),
}


def forward_outcomes(ours, zlab) -> dict[int, str]:
    """Each entry's draft-forward check on its fixed case: pass, fail or n/a."""
    found = {}
    for pitfall, case in FORWARD_CASES.items():
        seen = []
        cmp = Comparator(lambda status, *_: seen.append(status), f"forward-{pitfall}", REFERENCE_NAMES, pitfall)
        try:
            forward.draft_forward(cmp, ours, zlab, case)
        except Divergence:
            pass
        found[pitfall] = seen[-1]
    return found


def _window_one_wider(original):
    return lambda q_pos, k_pos, window: original(q_pos, k_pos, None if window is None else window + 1)


@pytest.mark.parametrize("plant, failing", [
    (planted._patch(DFlashDrafter, "forward", planted._positions_restart), 10),  # breaks the plain forward
    (planted._patch(impl.masks, "within_window", _window_one_wider), 11),  # breaks sliding layers only
], ids=["positions-restarting", "window-one-wider"])
def test_one_forward_root_cause_fails_one_entry(plant, failing, under_test, zlab, monkeypatch):
    """One bug in the draft forward fails the entry whose property it breaks, and only that one: the
    entries that add a property on top of it are n/a, naming where it is reported."""
    if under_test.name != "ours":
        pytest.skip("planted bugs mutate impl/: they apply to ours only")
    assert forward_outcomes(under_test, zlab) == dict.fromkeys(FORWARD_CASES, "pass")
    mutated = plant(monkeypatch, under_test)
    found = forward_outcomes(mutated, zlab)
    assert found[failing] == "fail"
    assert {pitfall for pitfall, status in found.items() if status == "fail"} == {failing}
    if failing == 10:
        assert set(found.values()) == {"fail", "n/a"}  # every other entry explained by the plain forward
    else:  # the sliding-window bug: the plain forward, positions and DFlash2's full-attention forward pass
        assert found == {10: "pass", 12: "pass", 11: "fail", 25: "n/a", 22: "pass", 35: "pass"}

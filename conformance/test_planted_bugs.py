"""Planted-bug self-test: every bug class in `planted.BUGS` must make its component check fail (and the
unmutated implementation must pass the same check). Results feed the report's detection table."""

import pytest

from conformance.comparator import Comparator, Divergence
from conformance.conftest import REFERENCE_NAMES
from conformance.planted import BUGS

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

    mutated = bug.plant(monkeypatch, under_test)
    entry = None
    try:
        bug.check(_quiet_comparator(request.node.nodeid, bug.pitfall), mutated, references)
    except Divergence as divergence:
        entry = divergence.entry
    recorder.add_planted(bug.name, bug.component, bug.pitfall, caught=entry is not None, diff=entry)
    assert entry is not None, f"planted bug {bug.name!r} was not caught by the {bug.component} check"
    assert entry.component == bug.component, f"caught, but reported under {entry.component!r}"

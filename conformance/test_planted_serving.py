"""Planted serving bugs: each broken drafter directory must give a `serving` divergence for its engine and field,
and the same directory unbroken must serve as trained. Results feed the report's planted-bug table."""

import pytest
import torch

from conformance.comparator import DiffEntry
from conformance.planted_serving import SERVING_BUGS, SPEC, served_report
from impl.model import DFlashDrafter

pytestmark = pytest.mark.quick


@pytest.fixture(scope="module")
def state_dict():
    torch.manual_seed(0)
    return DFlashDrafter(SPEC).state_dict()


@pytest.mark.parametrize("bug", SERVING_BUGS, ids=[bug.name for bug in SERVING_BUGS])
def test_planted_serving_bug_is_caught(bug, state_dict, tmp_path, recorder):
    clean = served_report(None, bug.engine, tmp_path, state_dict)
    assert [f for f in clean.findings if f.severity == "divergence"] == []
    report = served_report(bug, bug.engine, tmp_path, state_dict)
    caught = [f for f in report.findings if f.severity == "divergence" and f.field == bug.field]
    entry = DiffEntry("serving", bug.pitfall, (bug.engine, "trained"), caught[0].message,
                      values=(caught[0].served, caught[0].trained)) if caught else None
    recorder.add_planted(bug.name, "serving", bug.pitfall, caught=bool(caught), diff=entry)
    assert caught, f"planted serving bug {bug.name!r} not caught: {[f.to_dict() for f in report.findings]}"

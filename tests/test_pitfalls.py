"""One catalogue: catalogue/pitfalls.py feeds the findings, the conformance recorder and docs/pitfalls.md."""

from pathlib import Path

from catalogue.pitfalls import PITFALLS, markdown
from catalogue.rule_locations import AUDITED_BY, LOCATIONS
from catalogue.rule_locations import markdown as rule_table
from conformance.recorder import PITFALLS as SUITE
from catalogue.findings import PITFALLS as REPORT

REPO = Path(__file__).resolve().parents[1]


def test_the_committed_pitfalls_md_is_generated_from_the_catalogue():
    assert (REPO / "docs" / "pitfalls.md").read_text() == markdown(), \
        "run: python -m catalogue.pitfalls > docs/pitfalls.md"


def test_findings_and_the_suite_read_the_one_catalogue():
    assert list(PITFALLS) == sorted(set(PITFALLS)) and min(PITFALLS) == 1
    assert REPORT == {n: p.title for n, p in PITFALLS.items()}
    assert SUITE == {n: p.component for n, p in PITFALLS.items() if p.checked_by == "conformance"}
    assert {p.checked_by for p in PITFALLS.values()} == {"conformance", "audit"}


def test_every_suite_marker_names_a_catalogue_entry_of_its_component():
    import re

    markers = set()
    for path in (REPO / "conformance").glob("test_*.py"):
        markers |= {int(n) for n in re.findall(r"pytest\.mark\.pitfall\((\d+)\)", path.read_text())}
    assert markers and markers <= set(SUITE)


def test_the_docs_rule_table_is_generated_from_the_rule_locations():
    assert rule_table() in (REPO / "docs" / "layout.md").read_text(encoding="utf-8"), "run: python -m catalogue.rule_locations"


def test_every_rule_outside_the_serving_table_has_a_row():
    located = [n for location in LOCATIONS for n in location.entries]
    assert len(located) == len(set(located)), "an entry has two rows"
    assert set(located) <= set(PITFALLS)
    serving = {n for n, p in PITFALLS.items() if p.component == "serving"}
    assert set(PITFALLS) - serving == set(located), "add a row to catalogue/rule_locations.py"


def test_every_rule_names_the_audit_code_that_detects_it_and_that_code_exists():
    import importlib
    import inspect

    assert set(AUDITED_BY) == {location.entries[0] for location in LOCATIONS}, "each row says what audits it"
    for entry, names in AUDITED_BY.items():
        for name in names:
            module, _, function = f"dflash_audit.{name}".rpartition(".")
            found = getattr(importlib.import_module(module), function, None)
            assert inspect.isfunction(found), f"#{entry}: {name} is no function under dflash_audit/"
            assert "Finding(" in inspect.getsource(found) or "load_" in function, f"#{entry}: {name} makes no finding"

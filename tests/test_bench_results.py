"""The benchmark table of docs/results.md is bench/results.json as `python -m bench.results_table` renders it, verbatim."""

from __future__ import annotations

import json
from pathlib import Path

from bench.results_table import RESULTS, table_markdown

RESULTS_PAGE = Path(__file__).resolve().parent.parent / "docs" / "results.md"


def test_docs_bench_table_matches_results_json():
    results = json.loads(RESULTS.read_text())
    assert results, "bench/results.json holds no run"
    assert table_markdown(results) in RESULTS_PAGE.read_text(encoding="utf-8")


def test_every_bench_script_is_in_results_json():
    """`make bench` runs every bench in bench/, and each records its rows."""
    results = json.loads(RESULTS.read_text())
    scripts = sorted(p.stem.removeprefix("bench_") for p in RESULTS.parent.glob("bench_*.py"))
    recorded = {name.split("[")[0] for name in results}
    assert set(scripts) == recorded, (scripts, sorted(recorded))
    for entry in results.values():
        assert entry["rows"] and all({"value", "goal", "passed"} <= set(row) for row in entry["rows"])

"""Under pytest-xdist each worker records its own tests; the controller merges them into one report that
equals what a single process would have written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conformance.comparator import DiffEntry
from conformance.recorder import Recorder

pytestmark = pytest.mark.quick
VERSIONS = {"torch": "x"}
SITE = Path(pytest.__file__).resolve().parents[1]  # the venv's site-packages


def written(recorder: Recorder) -> dict:
    """results.json as the recorder writes it (JSON: pairs become lists)."""
    return json.loads(json.dumps(recorder.results(VERSIONS), default=str))


def key(test: str, pitfall: int = 4) -> dict:
    return {"component": "fc_dims", "pitfall": pitfall, "implementations": ["ours", "zlab"], "test": test}


def fail_entry() -> DiffEntry:
    return DiffEntry("fc_dims", 4, ("ours", "zlab"), "in_features 20480 != 25600", shapes=([1, 2], [1, 3]),
                     dtypes=("float32", "float32"), max_abs=1.5, values=(20480, 25600), test="t_fail")


def recorded(*, tests: list[str], fail: str | None = None) -> Recorder:
    recorder = Recorder()
    recorder.not_applicable("fc_dims", 4, ("ours", "speculators"), "t_na", "speculators has no fc")  # at collection
    for test in tests:
        recorder.sink("pass", None, key(test))
    if fail:
        recorder.sink("fail", fail_entry(), key(fail))
        recorder.add_planted("fc_over_4_of_5", "fc_dims", 4, caught=True, diff=fail_entry())
    return recorder


def test_merged_worker_records_equal_one_process():
    one_process = recorded(tests=["t_a", "t_b"], fail="t_fail")
    controller = Recorder()
    for worker in (recorded(tests=["t_a"], fail="t_fail"), recorded(tests=["t_b"])):
        controller.absorb(worker.export())
    assert written(controller) == written(one_process)


def test_the_worst_status_wins_and_the_diff_survives_the_round_trip():
    controller = Recorder()
    controller.absorb(recorded(tests=["t_fail"]).export())  # a pass first ...
    controller.absorb(recorded(tests=[], fail="t_fail").export())  # ... then the failure on another worker
    [row] = [r for r in controller.results(VERSIONS)["components"] if r["test"] == "t_fail"]
    assert row["status"] == "fail" and row["comparisons"] == 2
    assert row["diff"] == fail_entry().to_dict()
    assert controller.results(VERSIONS)["summary"]["planted_caught"] == 1


def test_two_references_that_differ_are_their_own_status_held_to_the_golden_list():
    """`references differ`, never pass; a disagreement not on the list, or a listed one that now agrees, is a change
    either way; a listed comparison that did not run is not judged."""
    from conformance.comparator import REFERENCES_DIFFER, Comparator
    from conformance.recorder import golden_changes

    recorder = Recorder()
    compare = Comparator(recorder.sink, "t_refs", frozenset({"speculators", "zlab"}), 16)
    assert compare.compare(("speculators", "zlab"), 8, 16) is not None  # recorded, not raised
    rows = written(recorder)["components"]
    assert [r["status"] for r in rows] == [REFERENCES_DIFFER]
    assert written(recorder)["references_differ"] == rows and written(recorder)["summary"][REFERENCES_DIFFER] == 1
    listed = {"component": rows[0]["component"], "pitfall": 16, "test": "t_refs",
              "implementations": ["speculators", "zlab"]}
    assert golden_changes(rows, [listed]) == {"gained": [], "lost": []}
    assert golden_changes(rows, []) == {"gained": rows, "lost": []}
    agreeing = [{**rows[0], "status": "pass", "diff": None}]
    assert golden_changes(agreeing, [listed]) == {"gained": [], "lost": [listed]}
    assert golden_changes([], [listed]) == {"gained": [], "lost": []}  # not run here: not judged


def test_every_known_reference_difference_names_a_test_and_says_why_and_where():
    import ast

    from conformance.recorder import known_differences

    repo = Path(__file__).resolve().parents[1]
    known = known_differences()
    assert known, "the golden list is empty"
    for item in known:
        path, _, name = item["test"].partition("::")
        functions = {node.name for node in ast.walk(ast.parse((repo / path).read_text()))
                     if isinstance(node, ast.FunctionDef)}
        assert name.split("[")[0] in functions, f"{item['test']}: no such test"
        assert item["explanation"].strip() and "\n" not in item["explanation"], item
        for source in item["source"].split("; "):  # inside the installed reference packages
            where, _, line = source.rpartition(":")
            lines = (SITE / where).read_text().splitlines()
            assert line.isdigit() and 1 <= int(line) <= len(lines), f"{source}: no such line"

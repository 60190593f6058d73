"""Under pytest-xdist each worker records its own tests; the controller merges them into one report that
equals what a single process would have written."""

from __future__ import annotations

import json

import pytest

from conformance.comparator import DiffEntry
from conformance.recorder import Recorder

pytestmark = pytest.mark.quick
VERSIONS = {"torch": "x"}


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

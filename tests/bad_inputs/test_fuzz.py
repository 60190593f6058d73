"""The fuzz of every reader (tests/bad_inputs/fuzz_readers.py), bounded and derandomized in `make test`
(FUZZ_EXAMPLES examples a reader, the same ones every run); `make fuzz` runs it longer with fresh examples
(DFLASH_FUZZ_EXAMPLES, DFLASH_FUZZ_RECORD=1) and adds the shrunk example of anything it finds to
fuzz_regressions.json, which is replayed here as regression cases."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings

from tests.bad_inputs.fuzz_readers import check_example, strategies

REGRESSIONS = Path(__file__).with_name("fuzz_regressions.json")
EXAMPLES = int(os.environ.get("DFLASH_FUZZ_EXAMPLES", "30"))
RECORD = os.environ.get("DFLASH_FUZZ_RECORD") == "1"
FOUND: dict[str, dict] = {}  # reader -> its last failing mutation (hypothesis replays the shrunk one last)


def recorded(reader: str, mutation: dict, world: Path) -> None:
    try:
        check_example(reader, mutation, world)
    except AssertionError:
        if RECORD:
            FOUND[reader] = mutation
        raise


def save_findings() -> None:
    """Called at the end of a `make fuzz` session: new findings join the regression cases."""
    if not FOUND:
        return
    cases = json.loads(REGRESSIONS.read_text()) if REGRESSIONS.exists() else []
    for reader, mutation in FOUND.items():
        case = {"reader": reader, "mutation": mutation}
        if case not in cases:
            cases.append(case)
    REGRESSIONS.write_text(json.dumps(cases, indent=1, default=str) + "\n")


def fuzz_settings():
    return settings(max_examples=EXAMPLES, derandomize=not RECORD, deadline=None, database=None,
                    suppress_health_check=list(HealthCheck), print_blob=False)


READERS = sorted(strategies())


@pytest.mark.parametrize("reader", READERS)
def test_fuzz_reader(reader, world):
    @fuzz_settings()
    @given(mutation=strategies()[reader])
    def one(mutation):
        recorded(reader, mutation, world)

    one()


def regression_cases() -> list:
    return json.loads(REGRESSIONS.read_text()) if REGRESSIONS.exists() else []


@pytest.mark.parametrize("case", regression_cases(), ids=lambda c: f"{c['reader']}-{json.dumps(c['mutation'])[:40]}")
def test_fuzz_regression(case, world):
    check_example(case["reader"], case["mutation"], world)


def test_every_reader_is_fuzzed():
    assert set(READERS) == {"config", "safetensors", "pickle", "yaml", "declaration", "index", "prompts", "key_map",
                            "serving"}

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
# Readers whose example runs a whole verb on a real engine file or recording (a GGUF through five verbs, a trace
# audit, two drafters built per example): fewer in `make test`'s bounded run, all of them under `make fuzz`.
BOUNDED = {"gguf": 12, "trace": 12, "recipe": 15}
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


def fuzz_settings(reader: str):
    examples = EXAMPLES if "DFLASH_FUZZ_EXAMPLES" in os.environ else BOUNDED.get(reader, EXAMPLES)
    return settings(max_examples=examples, derandomize=not RECORD, deadline=None, database=None,
                    suppress_health_check=list(HealthCheck), print_blob=False)


READERS = sorted(strategies())


def inputs_of(reader: str, request) -> Path:
    """The world a reader mutates: the hostile-input world, the converted test drafter's (gguf) or a recording
    (trace)."""
    if reader == "trace":
        return request.getfixturevalue("trace_world")
    if reader != "gguf":
        return request.getfixturevalue("world")
    from serving_engines.live.llamacpp_env import source_tree

    if not (source_tree() / "convert_hf_to_gguf.py").is_file() and not os.environ.get("CI"):
        pytest.skip("run `make setup` to unpack llama.cpp b11434 (its converter writes the GGUF mutated)")
    return request.getfixturevalue("gguf_world")


@pytest.mark.parametrize("reader", READERS)
def test_fuzz_reader(reader, request):
    world = inputs_of(reader, request)

    @fuzz_settings(reader)
    @given(mutation=strategies()[reader])
    def one(mutation):
        recorded(reader, mutation, world)

    one()


def regression_cases() -> list:
    return json.loads(REGRESSIONS.read_text()) if REGRESSIONS.exists() else []


@pytest.mark.parametrize("case", regression_cases(), ids=lambda c: f"{c['reader']}-{json.dumps(c['mutation'])[:40]}")
def test_fuzz_regression(case, request):
    check_example(case["reader"], case["mutation"], inputs_of(case["reader"], request))


def test_every_reader_is_fuzzed():
    assert set(READERS) == {"config", "safetensors", "pickle", "yaml", "declaration", "index", "prompts", "key_map",
                            "serving", "gguf", "trace", "recipe"}

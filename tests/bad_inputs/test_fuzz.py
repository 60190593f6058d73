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


# The live paths' findings, each through `serve-check --live` to its report (a real llama-server, b11434): the
# drafter reading the target's last layer (llama.cpp aborts: the capture finding), a quantized run (`--quant q8_0`: its
# cost) and an engine-side difference planted by a flag (`--spec-draft-n-max 3`: the engine drafts blocks of 3, which
# the live check localizes to the block length). None may reach
# the catch-all ("unexpected failure"), and every finding of the section reaches the terminal, serving.json and the page.
LIVE_CASES = {"reads the last layer": ("full", [], "live:target_layer_capture"),
              "quantized q8_0": ("full-1-2", ["--quant", "q8_0"], "live:quantization"),
              "a planted engine difference": ("full-1-2", ["--spec-draft-n-max", "3"], "live:block_length")}


@pytest.fixture(scope="module")
def live_inputs(test_world, tmp_path_factory) -> dict:
    from dflash_world.drafter import cached_full_drafter
    from drafter_files.checkpoint import load_checkpoint
    from drafter_files.zlab_format import save_zlab_dir
    from serving_engines.live.llamacpp_env import DEFAULT_VARIANT, build_dir
    from tests.family_fixtures import without_final_layer

    if not (build_dir(variant=DEFAULT_VARIANT) / "bin" / "llama-server").is_file() and not os.environ.get("CI"):
        pytest.skip("run `make setup` to build llama.cpp b11434")
    root = tmp_path_factory.mktemp("live-fuzz")
    prompts = root / "prompts.jsonl"
    prompts.write_text(Path(test_world.prompts).read_text().splitlines()[0] + "\n")
    full = cached_full_drafter(test_world)
    trained = load_checkpoint(full)
    save_zlab_dir(root / "full-1-2", *without_final_layer(trained.spec, trained.state_dict))  # what llama.cpp can feed
    return {"full": full, "full-1-2": root / "full-1-2", "prompts": prompts, "target": test_world.target}


# The same three llama-server runs are cases of tests/test_every_finding.py, which `make test` runs (each reaches every
# report, exit 0 or 1: never the catch-all), and test_live_llamacpp.py names each field (capture, n_max, quantization).
@pytest.mark.full
@pytest.mark.parametrize("case", sorted(LIVE_CASES))
def test_a_live_finding_reaches_its_report_not_the_catch_all(case, live_inputs, tmp_path, capsys, monkeypatch):
    from tests.report_checks import missing_from_reports, serve_case

    drafter, extra, field = LIVE_CASES[case]
    run = serve_case("live", ["--drafter", live_inputs[drafter], "--engine", "llamacpp", "--target",
                              live_inputs["target"], "--live", "--prompts", live_inputs["prompts"],
                              "--max-new-tokens", 16, *extra], tmp_path, capsys, monkeypatch)
    live = run.data["serving"]["llamacpp"]["live"]
    fields = {f["field"] for f in run.data["serving"]["llamacpp"]["findings"]}
    assert field in fields, fields  # the live finding, localized, among the engine's serving findings
    assert live["ran"] or live["findings"], live  # a refused run still says why, as findings
    missing = [(f.key, where) for f in run.findings for where in [missing_from_reports(f, run)] if where]
    assert not missing, missing

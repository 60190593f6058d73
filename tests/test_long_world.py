"""The test world's long context (dflash_world/long_context.py): prompts up to the target's 4096 positions, a target
trained on rows that long, and the mixed drafter (window 48, trained on 256-token rows) run past its window and its
trained length, where our loop, z-lab's `dflash_generate` and the offline replay must still walk alike."""

from __future__ import annotations

import json

import pytest
import torch

from dflash_audit.cli import main
from dflash_audit.prompts import load_prompts, tokenize_prompts
from dflash_audit.tau.along_context import greedy_agreement
from dflash_world.drafter import cached_long_drafter
from dflash_world.long_context import LONG_PROMPT_TOKENS, cached_long_prompts, cached_long_target
from drafter_files.checkpoint import load_checkpoint
from foundation.target import load_target
from impl.body_shapes import build_drafter
from impl.decoding import dflash_decode
from reference_adapters.zlab_adapter import zlab_generate, zlab_twin


@pytest.fixture(scope="module")
def long_world(test_world):
    return cached_long_target(test_world), cached_long_drafter(test_world), cached_long_prompts(test_world)


def test_long_prompts_reach_the_targets_last_positions(long_world):
    target_dir, _, prompts_path = long_world
    target, tokenizer = load_target(target_dir)
    lengths = [ids.shape[1] for _, ids in tokenize_prompts(tokenizer, load_prompts(prompts_path))]
    assert all(length <= cap for length, cap in zip(lengths, LONG_PROMPT_TOKENS)), lengths
    assert lengths[-1] + 64 > 4000 and lengths[-1] + 64 <= target.config.max_position_embeddings, lengths


def test_the_long_target_agrees_with_the_text_past_the_short_targets_trained_length(long_world, test_world):
    """Trained on 4096-token rows, the long target predicts the held-out text past position 256 better than the test
    target (256-token rows) it was trained on from: the target's own extrapolation is what the long target removes."""
    target_dir, _, prompts_path = long_world
    short, tokenizer = load_target(test_world.target)
    long_, _ = load_target(target_dir)
    ids = tokenize_prompts(tokenizer, load_prompts(prompts_path))[-1][1]
    past = {name: sum(agreed[256:]) / len(agreed[256:])
            for name, agreed in (("short", greedy_agreement(short, ids)), ("long", greedy_agreement(long_, ids)))}
    assert past["long"] > past["short"], past


def test_our_loop_and_zlabs_walk_alike_past_the_window_on_a_long_prompt(long_world):
    """The mixed drafter on the 1024-token prompt: every round past its window of 48 (and its trained 256), ours and
    z-lab's `dflash_generate` round for round, token for token."""
    target_dir, drafter_path, prompts_path = long_world
    target, tokenizer = load_target(target_dir)
    ckpt = load_checkpoint(drafter_path)
    drafter = build_drafter(ckpt.spec, ckpt.state_dict).eval()
    _, ids = tokenize_prompts(tokenizer, load_prompts(prompts_path))[1]
    with torch.inference_mode():
        ours = dflash_decode(drafter, target, ids, 32, [])
        ref = zlab_generate(zlab_twin(drafter), target, ids, 32, [])
    assert ours.acceptance_lengths == ref.acceptance_lengths and torch.equal(ours.output_ids, ref.output_ids)
    assert ours.tau > 1.2  # the drafter accepts past its window: the walk is not trivial


def test_eval_offline_bins_tau_along_the_long_context(long_world, tmp_path, capsys):
    target_dir, drafter_path, prompts_path = long_world
    out = tmp_path / "eval.json"
    assert main(["eval", "--drafter", str(drafter_path), "--target", str(target_dir), "--prompts", str(prompts_path),
                 "--mode", "offline", "--max-new-tokens", "32", "--json", str(out),
                 "--cache-dir", str(tmp_path / "cache")]) == 0
    payload = json.loads(out.read_text())
    along = payload["along_context"]
    starts = [b["start"] for b in along["by_position"]]
    assert starts[0] == 0 and starts[-1] == 3840  # the prompts' text from position 1, the rounds up to 4096
    rounds = [b for b in along["by_position"] if b["rounds"]]
    assert sum(b["rounds"] for b in rounds) == sum(len(p["rounds"]) for p in payload["prompts"])
    assert rounds[-1]["start"] == 3840 and rounds[0]["start"] >= 256  # every round past the trained length
    assert all(b["past"] == ["sliding window 48", "trained length 256"] for b in rounds)
    assert [b["start"] for b in along["by_prompt_length"]] == [256, 768, 1792, 3840]
    assert along["marks"]["max_position_embeddings"] == 4096
    assert "past" in capsys.readouterr().out

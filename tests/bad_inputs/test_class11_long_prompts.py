"""Class 11, prompts past the target's context (the test world's target holds 4,096 positions): to `eval` live, offline
and as a τ table, as a prompt or a z-lab turn, to `compare`'s dynamic audit, a budget that leaves no room for any
prompt, and a hidden-state record longer than the target's context to `data-check`. Each is one line and exit 2
naming the prompt or record and the target's context (never the catch-all), refused before any report or cache
entry is written: nothing is left behind."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tests.bad_inputs.cli_run import assert_refused, run, tree_digest

LONG = "def f(): pass " * 3000  # past 4,096 tokens


def _prompts(folder: Path, *records: dict) -> Path:
    path = folder / "long.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def eval_args(world, folder: Path, records: list[dict], *extra) -> tuple[list, tuple]:
    from dflash_world.drafter import cached_test_drafter

    prompts = _prompts(folder, *records)
    return (["eval", "--drafter", cached_test_drafter(world), "--target", world.target, "--prompts", prompts,
             "--max-new-tokens", "8", "--json", folder / "eval.json", "--cache-dir", folder / "cache", *extra],
            ("long.jsonl", "max_position_embeddings"))


def compare_args(world, folder: Path, records: list[dict], *extra) -> tuple[list, tuple]:
    from dflash_world.drafter import cached_full_drafter, cached_test_drafter

    prompts = _prompts(folder, *records)
    return (["compare", "--ours", cached_test_drafter(world), "--ref", cached_full_drafter(world), "--target",
             world.target, "--prompts", prompts, "--max-new-tokens", "8", "--out", folder / "report",
             "--cache-dir", folder / "cache", *extra], ("long.jsonl", "max_position_embeddings"))


CASES = {
    "eval_live": lambda w, f: eval_args(w, f, [{"id": "long", "prompt": LONG}]),
    "eval_live_after_a_short_one": lambda w, f: eval_args(w, f, [{"id": "short", "prompt": "x = 1"},
                                                                 {"id": "long", "prompt": LONG}]),
    "eval_a_zlab_turn": lambda w, f: eval_args(w, f, [{"turns": [LONG, "and then?"]}]),
    "eval_offline": lambda w, f: eval_args(w, f, [{"id": "long", "prompt": LONG}], "--mode", "offline"),
    "eval_ddtree": lambda w, f: eval_args(w, f, [{"id": "long", "prompt": LONG}], "--method", "ddtree"),
    "eval_table": lambda w, f: eval_args(w, f, [{"id": "long", "prompt": LONG}], "--table"),
    "eval_budget_past_the_context": lambda w, f: (eval_args(w, f, [{"id": "s", "prompt": "x = 1"}])[0][:-4]
                                                  + ["--max-new-tokens", "5000", "--cache-dir", f / "cache"],
                                                  ("--max-new-tokens", "max_position_embeddings")),
    "compare_dynamic": lambda w, f: compare_args(w, f, [{"id": "long", "prompt": LONG}]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_prompt_past_the_context_is_one_line_and_leaves_nothing(test_world, tmp_path, capsys, case):
    argv, names = CASES[case](test_world, tmp_path)
    before = tree_digest(tmp_path)
    code, _, err = run(argv, capsys)
    assert_refused(code, err, *names)
    assert tree_digest(tmp_path) == before  # no report, no JSON, no cache entry


def test_a_record_past_the_context_is_one_line(test_world, tmp_path, capsys):
    """A hidden-state record of more tokens than the target holds positions: the target cannot recompute its states."""
    config = json.loads((Path(test_world.target) / "config.json").read_text())
    tokens = config["max_position_embeddings"] + 5
    dataset = tmp_path / "dataset"
    dataset.mkdir()
    save_file({"hidden_states": torch.zeros(tokens, 2, config["hidden_size"]),
               "token_ids": torch.arange(tokens) % 100}, str(dataset / "hs_0.safetensors"))
    before = tree_digest(tmp_path)
    code, _, err = run(["data-check", dataset, "--target", test_world.target, "--layer-ids", "1,2", "--out",
                        tmp_path / "report"], capsys)
    assert_refused(code, err, "hs_0.safetensors", "max_position_embeddings")
    assert tree_digest(tmp_path) == before

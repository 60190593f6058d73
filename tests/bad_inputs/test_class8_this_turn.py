"""Class 8, this turn's inputs: a trainer that crashes in the middle of its step, a prompt longer than the target's
context, a hidden-state dataset whose report would replace a user's file. Each is one line and exit 2, nothing the
tool did not write is overwritten, and nothing is left behind (a failed trace removes its partial recording and the
folder it made)."""

from __future__ import annotations

import json
import sys

from tests.bad_inputs.cli_run import assert_refused, run, tree_digest

CRASHING_TRAINER = """
import torch
from transformers import AutoModelForCausalLM

target = AutoModelForCausalLM.from_pretrained({target!r})
drafter = torch.nn.Linear(target.config.hidden_size, target.config.hidden_size)
ids = torch.arange(16).unsqueeze(0)
with torch.no_grad():
    hidden = target(ids, output_hidden_states=True).hidden_states[-1]
drafter(hidden).pow(2).mean().backward()
raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")  # mid-step: before the optimizer steps
"""


def test_a_trainer_crashing_mid_step_is_one_line_and_leaves_nothing(test_world, tmp_path, capsys):
    script = tmp_path / "crashing_trainer.py"
    script.write_text(CRASHING_TRAINER.format(target=str(test_world.target)))
    before = tree_digest(tmp_path)
    code, _, err = run(["trace", "--out", tmp_path / "trace", "--", sys.executable, script], capsys)
    line = assert_refused(code, err.strip().splitlines()[-1] + "\n", "crashing_trainer.py", "CUDA out of memory")
    assert "exited with status 1" in line
    assert tree_digest(tmp_path) == before  # no partial recording, no folder


def test_a_trace_crash_keeps_a_users_folder_as_it_was(test_world, tmp_path, capsys):
    script = tmp_path / "crashing_trainer.py"
    script.write_text(CRASHING_TRAINER.format(target=str(test_world.target)))
    (tmp_path / "trace").mkdir()
    before = tree_digest(tmp_path)
    code, _, err = run(["trace", "--out", tmp_path / "trace", "--", sys.executable, script], capsys)
    assert_refused(code, err.strip().splitlines()[-1] + "\n", "CUDA out of memory")
    assert tree_digest(tmp_path) == before  # the empty folder the user made is kept, and stays empty


def test_a_prompt_past_the_context_is_refused_before_anything_is_written(test_world, tmp_path, capsys):
    from dflash_world.drafter import cached_test_drafter

    prompts = tmp_path / "long.jsonl"
    prompts.write_text(json.dumps({"id": "long", "prompt": "def f(): pass " * 3000}) + "\n")
    before = tree_digest(tmp_path)
    code, _, err = run(["eval", "--drafter", cached_test_drafter(test_world), "--target", test_world.target,
                        "--prompts", prompts, "--max-new-tokens", "8", "--json", tmp_path / "eval.json"], capsys)
    assert_refused(code, err, "long.jsonl", "'long'", "max_position_embeddings", "--truncate")
    assert tree_digest(tmp_path) == before


def test_a_dataset_report_never_replaces_a_users_file(test_world, tmp_path, capsys):
    (tmp_path / "records").mkdir()
    out = tmp_path / "report"
    out.mkdir()
    (out / "report.json").write_text('{"mine": true}\n')
    before = tree_digest(tmp_path)
    code, _, err = run(["data-check", tmp_path / "records", "--target", test_world.target, "--out", out], capsys)
    assert_refused(code, err, "--out", "report.json")
    assert tree_digest(tmp_path) == before

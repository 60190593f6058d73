"""Class 12, a traced trainer that crashes in the middle of its step: raising before the backward, inside it (a hook),
in a forward hook, exiting with its own status, killed by a signal, interrupted, or dying with a message of many
lines, terminal escapes and bytes that are not UTF-8. `trace` says the command's own last words in one line with
exit 2 (never the catch-all, no exception class name), and leaves nothing behind: no partial recording, not the
folder it made, and a user's folder as it was."""

from __future__ import annotations

import sys

import pytest

from tests.bad_inputs.cli_run import assert_refused, run, tree_digest

TRAINER = """
import os, signal, sys
import torch
from transformers import AutoModelForCausalLM

target = AutoModelForCausalLM.from_pretrained({target!r})
drafter = torch.nn.Linear(target.config.hidden_size, target.config.hidden_size)
optimizer = torch.optim.AdamW(drafter.parameters(), lr=1e-3)
ids = torch.arange(16).unsqueeze(0)
with torch.no_grad():
    hidden = target(ids, output_hidden_states=True).hidden_states[-1]
loss = drafter(hidden).pow(2).mean()
{crash}
"""

# case -> (the crash, put in the middle of the step; what the one line must name)
CASES = {
    "raises_before_backward": ('raise ValueError("labels and logits differ in length: 15 vs 16")',
                               "labels and logits differ in length"),
    "raises_inside_backward": ('drafter.weight.register_hook(lambda g: (_ for _ in ()).throw(RuntimeError('
                               '"NaN in the gradient of fc")))\nloss.backward()', "NaN in the gradient of fc"),
    # (a crash inside the optimizer's step is never reached: the step is recorded when it begins, and the script ends)
    "raises_inside_a_forward_hook": ('drafter.register_forward_hook(lambda *a: (_ for _ in ()).throw(RuntimeError('
                                     '"mat1 and mat2 shapes cannot be multiplied")))\ndrafter(hidden)',
                                     "mat1 and mat2 shapes cannot be multiplied"),
    "exits_with_its_own_status": ('loss.backward()\nprint("giving up", file=sys.stderr)\nsys.exit(3)',
                                  "exited with status 3"),
    "exits_at_once": ('loss.backward()\nos._exit(9)', "exited with status 9"),
    "killed_by_a_signal": ('loss.backward()\nos.kill(os.getpid(), signal.SIGKILL)', "killed by signal 9 (SIGKILL)"),
    "interrupted": ('loss.backward()\nraise KeyboardInterrupt', "exited with status"),
    "dies_with_escapes_and_many_lines": (
        'loss.backward()\nsys.stderr.buffer.write(b"\\x1b[31mboom\\x1b[0m\\nline two\\n\\xff\\xfe bytes\\n")\n'
        'sys.stderr.flush()\nos._exit(4)', "exited with status 4"),
    "dies_with_a_huge_message": ('loss.backward()\nraise RuntimeError("x" * 200_000)', "exited with status 1"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_trainer_crashing_mid_step_is_one_line_and_leaves_nothing(test_world, tmp_path, capsys, case):
    crash, named = CASES[case]
    script = tmp_path / "crashing_trainer.py"
    script.write_text(TRAINER.format(target=str(test_world.target), crash=crash))
    before = tree_digest(tmp_path)
    code, _, err = run(["trace", "--out", tmp_path / "trace", "--", sys.executable, script], capsys)
    line = assert_refused(code, err.strip().splitlines()[-1] + "\n", "crashing_trainer.py", named)
    assert "\x1b" not in line and len(line) < 2000, line
    assert tree_digest(tmp_path) == before  # no partial recording, no folder


def test_a_crash_keeps_a_users_folder_and_its_files(test_world, tmp_path, capsys):
    crash, named = CASES["exits_with_its_own_status"]
    script = tmp_path / "crashing_trainer.py"
    script.write_text(TRAINER.format(target=str(test_world.target), crash=crash))
    (tmp_path / "trace").mkdir()
    (tmp_path / "trace" / "notes.txt").write_text("mine\n")
    before = tree_digest(tmp_path)
    code, _, err = run(["trace", "--out", tmp_path / "trace", "--", sys.executable, script], capsys)
    assert code == 2
    assert tree_digest(tmp_path) == before

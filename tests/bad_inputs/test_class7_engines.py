"""Class 7, an engine that is not there or does not do its job: `serve-check --live --vllm-python` naming a
program that is missing, answers nothing, crashes, or hangs. Each is one line and exit 2; a hung engine is stopped
with every process it started (its session), and the run's scratch folder goes with it. (These programs are hostile
inputs, not stand-ins for vLLM: the live check against the real engine is tests/test_live_check.py.)"""

from __future__ import annotations

import os
import signal
import tempfile
import time

import pytest

from tests.bad_inputs.cli_run import assert_refused, run

PROBE_ANSWER = '{"version": "0.33.0", "root": "/nonexistent", "cuda": false}'


def program(path, engine_part: str):
    """A program that answers the vLLM probe (`python -c ...`) as vLLM would, then, run as the engine, does
    `engine_part`."""
    path.write_text(f"#!/bin/sh\nif [ \"$1\" = -c ]; then echo '{PROBE_ANSWER}'; exit 0; fi\n{engine_part}\n")
    path.chmod(0o755)
    return path


def gone(pid: int) -> bool:
    """The process has ended (a zombie no one reaped has ended too); SIGKILL lands within moments."""
    for _ in range(100):
        try:
            if open(f"/proc/{pid}/stat").read().split(") ")[-1].startswith("Z"):
                return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


def test_a_missing_silent_crashing_or_hung_engine_is_one_line_and_leaves_nothing(world, tmp_path, capsys,
                                                                                 monkeypatch):
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))  # where the live check's scratch folder would stay
    monkeypatch.setenv("DFLASH_AUDIT_ENGINE_TIMEOUT_S", "3")
    silent = tmp_path / "silent"
    silent.write_text("#!/bin/sh\nexit 0\n")
    silent.chmod(0o755)
    crash = program(tmp_path / "crash", "echo 'Fatal Python error: Segmentation fault' >&2; exit 139")
    hang = program(tmp_path / "hang", f"sleep 600 & echo $! > {tmp_path}/child.pid; sleep 600")
    cases = ((tmp_path / "missing", "does not exist"), (silent, "does not answer as a Python with vLLM"),
             (crash, "Segmentation fault"), (hang, "ran past 3 s"))
    for python, why in cases:
        code, _, err = run(["serve-check", "--drafter", world / "zref", "--target", world / "target", "--prompts",
                            world / "prompts.jsonl", "--live", "--vllm-python", python,
                            "--max-new-tokens", "8"], capsys)  # the world's target holds 64 positions
        assert_refused(code, err, python.name, why)
        assert list(scratch.iterdir()) == [], (python.name, list(scratch.iterdir()))
    assert gone(int((tmp_path / "child.pid").read_text())), "the hung engine's child is still running"


@pytest.mark.parametrize("trap, killed_by", [("", signal.SIGTERM), ("trap '' TERM; ", signal.SIGKILL)])
def test_stopping_an_engine_stops_its_group_and_kills_what_ignores_sigterm_after_the_wait(tmp_path, trap, killed_by):
    """`stop_engine`, which both engines' hosts use: SIGTERM to the engine's whole group; one that ignores it (and its
    child, which inherits that) is killed when the bounded wait is over; the engine is reaped, its child gone."""
    from serving_engines.live.engine_process import start_engine, stop_engine

    child = tmp_path / "child.pid"
    with (tmp_path / "engine.log").open("w") as log:
        engine = start_engine(["/bin/sh", "-c", f"{trap}sleep 600 & echo $! > {child}; wait"], log, os.environ)
    for _ in range(200):  # the shell has started its child
        if child.is_file() and child.read_text().strip():
            break
        time.sleep(0.025)
    stop_engine(engine, wait_s=0.5)
    assert engine.returncode == -killed_by
    assert gone(int(child.read_text()))

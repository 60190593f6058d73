"""Class 13, the traced process's life: `trace` runs a user's command in its own process group, so that SIGTERM and
Ctrl-C sent to `trace` end the whole job; `--steps N` ends a script whose own thread never ends; `--timeout` stops a
command that never reaches its first step; a command that ends oddly (os._exit, `python -I`, no step, a trainer
under --eval, a --drafter-class that fits nothing) is said as what really happened; every bad flag is refused before
the command runs; `doctor`'s engine probes stop what they started and read any bytes. Each case: the exit status, the
one line, and no process of the command left behind (the pids the user's script wrote, and its process group).

The scripts are written as a user writes them; the training ones train a linear drafter on a tiny random target's
logits (tests/conftest.py's tiny world), the others import nothing heavy."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.bad_inputs.cli_run import assert_refused, run, tree_digest

REPO = Path(__file__).resolve().parents[2]

# What a user's script does to note its processes: `pids <process> <its group> <a child it started>...`.
NOTE_PIDS = """
import os, subprocess, sys
child = subprocess.Popen(["sleep", "600"])
with open(sys.argv[1] + ".tmp", "w") as note:
    note.write(f"{os.getpid()} {os.getpgid(0)} {child.pid}")
os.replace(sys.argv[1] + ".tmp", sys.argv[1])
"""

# A user's launcher: a helper beside the training script (a metrics server), its pids noted at once, then Python.
LAUNCHER = """#!/bin/sh
sleep 600 &
echo "$$ $(cut -d' ' -f5 /proc/$$/stat) $!" > "$1.tmp" && mv "$1.tmp" "$1"
exec {python} {script}
"""

TRAIN = """
import torch
from transformers import AutoModelForCausalLM

target = AutoModelForCausalLM.from_pretrained({target!r}).requires_grad_(False)
drafter = torch.nn.Linear(target.config.vocab_size, target.config.vocab_size)
optimizer = torch.optim.SGD(drafter.parameters(), lr=0.1)


def train_step():
    loss = drafter(target(torch.arange(1, 9)[None]).logits).logsumexp(-1).mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
"""


def alive(pid: int) -> bool:
    """A process that still runs (one exited and not yet reaped by its parent does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2] not in "ZX"


def in_group(group: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if stat[stat.rfind(")") + 2:].split()[2] == str(group) and alive(int(entry.name)):
                found.append(int(entry.name))
    return found


def left_behind(note: Path) -> list[int]:
    """The processes the script noted, and any of its process group, still running."""
    pid, group, *children = (int(word) for word in note.read_text().split())
    assert group == pid, "the traced command runs as the leader of its own process group"
    return sorted({p for p in (pid, *children) if alive(p)} | set(in_group(group)))


def user_script(folder: Path, name: str, body: str) -> Path:
    path = folder / name
    path.write_text(body)
    return path


def trainer(tiny_world: Path) -> str:
    return TRAIN.format(target=str(tiny_world / "target"))


def trace_in_a_process(argv: list, timeout: float = 300) -> subprocess.Popen:
    """`dflash-audit trace ARGV` as its own process (its own session: a test that fails kills all of it)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    return subprocess.Popen([sys.executable, "-m", "dflash_audit.cli", "trace", *map(str, argv)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def finish(process: subprocess.Popen, timeout: float = 300) -> tuple[int, str, str]:
    try:
        out, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
        raise AssertionError("trace did not return") from None
    return process.returncode, out, err


def wait_for(path: Path, process: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert process.poll() is None, finish(process)
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.1)


# -- 1. SIGTERM and Ctrl-C sent to trace end the whole group ------------------------------------------------------
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_to_trace_ends_the_command_and_all_it_started(tmp_path, signum):
    note = tmp_path / "note" / "pids"
    note.parent.mkdir()
    script = user_script(tmp_path, "train.py", "import time\ntime.sleep(600)\n")
    launch = user_script(tmp_path, "launch.sh", LAUNCHER.format(python=sys.executable, script=script))
    trace = trace_in_a_process(["--out", tmp_path / "trace", "--", "sh", launch, note])
    wait_for(note, trace)  # the launcher runs; Python is starting (the recorder's imports) or sleeping
    os.kill(trace.pid, signum)
    code, _, err = finish(trace)
    assert code == 128 + signum, err
    line = err.strip().splitlines()[-1]
    assert line.startswith("dflash-audit: error: ") and f"stopped by {signum.name}" in line, line
    assert "rerun with --debug" not in line
    assert left_behind(note) == []
    assert not (tmp_path / "trace").exists()  # the folder it made, removed with the partial recording


# -- 2. --steps N ends a script whose own thread never ends -------------------------------------------------------
def test_steps_end_a_script_whose_thread_never_ends(tiny_world, tmp_path):
    note = tmp_path / "pids"
    user_script(tmp_path, "model_step.py", trainer(tiny_world))
    script = user_script(tmp_path, "train.py", NOTE_PIDS + (
        "import threading\n"
        "threading.Thread(target=threading.Event().wait, name='heartbeat').start()  # never ends, not a daemon\n"
        "sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))\n"
        "from model_step import train_step\n"
        "for _ in range(5):\n"
        "    train_step()\n"))
    code, out, err = finish(trace_in_a_process(["--out", tmp_path / "trace", "--", sys.executable, script, note]))
    assert code == 0, err
    assert "1 step recorded" in out and (tmp_path / "trace" / "report.json").is_file()
    assert left_behind(note) == []


# -- 3. --timeout: a command that never reaches its first step ----------------------------------------------------
def test_timeout_stops_a_command_that_never_reaches_a_step(tmp_path, capsys):
    note = tmp_path / "pids"
    script = user_script(tmp_path, "train.py", "import time\ntime.sleep(600)  # waiting on a lock\n")
    launch = user_script(tmp_path, "launch.sh", LAUNCHER.format(python=sys.executable, script=script))
    code, _, err = run(["trace", "--timeout", "2", "--out", tmp_path / "trace", "--", "sh", launch, note], capsys)
    assert_refused(code, err.strip().splitlines()[-1], "launch.sh", "no training step within --timeout 2 s",
                   "every process it started")
    assert left_behind(note) == []
    assert not (tmp_path / "trace").exists()


def test_the_timeout_bounds_only_the_way_to_the_first_step(tmp_path):
    """A command that has begun its steps runs on past the bound (the recorder's mark is what `begun` reads)."""
    from dflash_audit.trace.record.traced_process import run_in_group

    ended = run_in_group(["sh", "-c", "sleep 1; echo done"], dict(os.environ), "sh", 0.2, begun=lambda: True)
    assert ended.status == 0 and ended.stdout_tail == ["done"]


@pytest.mark.parametrize("value, named", [("0", "must be positive"), ("-3", "must be positive"),
                                          ("nan", "--timeout"), ("soon", "--timeout")])
def test_timeout_takes_a_positive_number_of_seconds(tmp_path, capsys, value, named):
    ran = tmp_path / "ran"
    code, _, err = run(["trace", "--timeout", value, "--out", tmp_path / "trace", "--", "touch", ran], capsys)
    assert_refused(code, err, named)
    assert not ran.exists()


def test_timeout_with_from_is_refused(tmp_path, capsys):
    code, _, err = run(["trace", "--from", tmp_path, "--timeout", "5"], capsys)
    assert_refused(code, err, "--timeout", "--from")


# -- 4. commands that end oddly, said as what happened ------------------------------------------------------------
def test_os_exit_after_a_step_is_said_as_such(tiny_world, tmp_path, capsys):
    note = tmp_path / "pids"
    script = user_script(tmp_path, "train.py", NOTE_PIDS + trainer(tiny_world) + "train_step()\n"
                         "os._exit(0)  # skip the slow teardown\n")
    code, _, err = run(["trace", "--steps", "2", "--out", tmp_path / "trace", "--", sys.executable, script, note],
                       capsys)
    line = assert_refused(code, err.strip().splitlines()[-1], "train.py", "os._exit", "--steps 2")
    assert "without a training step" not in line
    assert left_behind(note) == []


def test_python_dash_i_is_named_as_the_reason_nothing_was_recorded(tmp_path, capsys):
    note = tmp_path / "pids"
    script = user_script(tmp_path, "train.py", NOTE_PIDS + (
        "import torch\n"
        "w = torch.nn.Linear(4, 4)\n"
        "optimizer = torch.optim.SGD(w.parameters(), lr=0.1)\n"
        "for _ in range(3):\n"
        "    w(torch.ones(2, 4)).sum().backward()\n"
        "    optimizer.step()\n"))
    code, _, err = run(["trace", "--out", tmp_path / "trace", "--", sys.executable, "-I", script, note], capsys)
    line = assert_refused(code, err.strip().splitlines()[-1], "train.py", "started with -I", "PYTHONPATH")
    assert "without a training step" not in line
    assert left_behind(note) == []


def test_a_python_whose_torch_cannot_load_is_named_with_its_reason(tmp_path, capsys, monkeypatch):
    """The user's PYTHONPATH holds a torch built for another machine: the recorder cannot be installed there."""
    broken = tmp_path / "site" / "torch"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text('raise ImportError("libtorch_cpu.so: cannot open shared object file")\n')
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "site"))
    note = tmp_path / "pids"
    script = user_script(tmp_path, "train.py", NOTE_PIDS + "print('no torch here')\n")
    code, _, err = run(["trace", "--out", tmp_path / "trace", "--", sys.executable, script, note], capsys)
    assert_refused(code, err.strip().splitlines()[-1], "train.py", "recorder could not be installed",
                   "libtorch_cpu.so: cannot open shared object file")
    assert left_behind(note) == []


def test_a_script_that_takes_no_step_is_one_true_line(tmp_path, capsys):
    note = tmp_path / "pids"
    script = user_script(tmp_path, "prepare.py", NOTE_PIDS + "print('tokenized 3 shards')\n")
    code, _, err = run(["trace", "--out", tmp_path / "trace", "--", sys.executable, script, note], capsys)
    assert_refused(code, err.strip().splitlines()[-1], "prepare.py", "finished without a training step")
    assert left_behind(note) == []


FEATURE_TRAINER = """
import torch
from transformers import AutoModelForCausalLM

target = AutoModelForCausalLM.from_pretrained({target!r}).requires_grad_(False)
drafter = torch.nn.Linear(target.config.hidden_size, target.config.hidden_size)
optimizer = torch.optim.AdamW(drafter.parameters(), lr=1e-3)
for _ in range(2):
    with torch.no_grad():
        hidden = target(torch.arange(16)[None], output_hidden_states=True).hidden_states[-1]
    drafter(hidden).pow(2).mean().backward()
    optimizer.step()
"""


def test_a_trainer_under_eval_is_told_to_drop_eval(tiny_world, tmp_path, capsys):
    """Its drafter fed the target's features is recorded as an evaluation, in which no round is found."""
    note = tmp_path / "pids"
    script = user_script(tmp_path, "train.py", NOTE_PIDS + FEATURE_TRAINER.format(target=str(tiny_world / "target")))
    code, _, err = run(["trace", "--eval", "--out", tmp_path / "trace", "--", sys.executable, script, note],
                       capsys)
    assert_refused(code, err.strip().splitlines()[-1], "train.py", "no evaluation round under --eval",
                   "without --eval")
    assert left_behind(note) == []


def test_a_drafter_class_that_fits_nothing_names_the_flag(tmp_path, capsys):
    note = tmp_path / "pids"
    script = user_script(tmp_path, "train.py", NOTE_PIDS + (
        "import torch\n"
        "model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))\n"
        "model(torch.ones(2, 8)).sum().backward()\n"))
    code, _, err = run(["trace", "--drafter-class", "__main__:DraftModel", "--out", tmp_path / "trace", "--",
                        sys.executable, script, note], capsys)
    line = assert_refused(code, err.strip().splitlines()[-1], "has no class DraftModel")
    assert line.startswith("dflash-audit: error: --drafter-class __main__:DraftModel:"), line  # not the script's
    assert left_behind(note) == []


# -- 5. every flag read before the command runs -------------------------------------------------------------------
def bad_flags(tmp_path: Path) -> dict[str, tuple[list, tuple]]:
    (tmp_path / "notes.json").write_text('{"mine": 1}\n')
    (tmp_path / "ref.json").write_text("{ not json\n")
    (tmp_path / "empty-ref.json").write_text('{"hidden_size": 64}\n')
    (tmp_path / "users").mkdir()
    (tmp_path / "users" / "keep.txt").write_text("mine\n")
    return {
        "ref not JSON": (["--ref", tmp_path / "ref.json"], ("--ref", "not valid JSON")),
        "ref declares nothing": (["--ref", tmp_path / "empty-ref.json"], ("--ref", "declares none of")),
        "ref missing": (["--ref", tmp_path / "nowhere.json"], ("--ref", "no such file")),
        "json over a user's file": (["--json", tmp_path / "notes.json"], ("--json", "not written by dflash-audit")),
        "json a folder": (["--json", tmp_path / "users"], ("--json", "not a regular file")),
        "out holds a user's files": (["--out", tmp_path / "users"], ("--out", "did not write")),
        "target not a model": (["--target", tmp_path / "users"], ("--target", "config.json missing")),
        "drafter not a folder": (["--drafter", tmp_path / "nowhere"], ("--drafter", "config.json missing")),
        "drafter class not MODULE:CLASS": (["--drafter-class", "my drafter:Model"], ("--drafter-class",
                                                                                      "MODULE:CLASS")),
    }


BAD_FLAGS = ("ref not JSON", "ref declares nothing", "ref missing", "json over a user's file", "json a folder",
             "out holds a user's files", "target not a model", "drafter not a folder", "drafter class not MODULE:CLASS")


@pytest.mark.parametrize("case", BAD_FLAGS)
def test_a_bad_flag_is_refused_before_the_command_runs(tmp_path, capsys, case):
    flags, named = bad_flags(tmp_path)[case]
    ran = tmp_path / "ran"
    argv = ["trace", *flags] + ([] if "--out" in flags else ["--out", tmp_path / "trace"])
    before = tree_digest(tmp_path)
    code, _, err = run([*argv, "--", "touch", ran], capsys)
    assert_refused(code, err, *named)
    assert not ran.exists(), "the command ran before its flags were read"
    assert tree_digest(tmp_path) == before


# -- 6. doctor's engine probes -------------------------------------------------------------------------------------
HANGING_ENGINE = """#!/bin/sh
sleep 600 &
echo "$$ $!" > {note}.tmp && mv {note}.tmp {note}
sleep 600
"""


def doctor(capsys, tmp_path: Path, *argv) -> dict:
    """`doctor --json`, the engine not under test named where none is (so that no real engine is asked)."""
    absent = ["--vllm-python", tmp_path / "no-python"] if "--vllm-python" not in argv else \
        ["--llamacpp-bin", tmp_path / "no-bin"]
    code, out, err = run(["doctor", "--json", *argv, *absent], capsys)
    assert code == 0, err
    return json.loads(out)


def test_doctors_engine_timeout_stops_all_the_engine_started(tmp_path, capsys, monkeypatch):
    note = tmp_path / "pids"
    python = tmp_path / "python"
    python.write_text(HANGING_ENGINE.format(note=note))
    python.chmod(0o755)
    monkeypatch.setenv("DFLASH_AUDIT_ENGINE_TIMEOUT_S", "2")
    engine = doctor(capsys, tmp_path, "--vllm-python", python)["engines"]["vllm-python"]
    assert engine["found"] is False and "did not answer the vLLM import within 2 s" in engine["problem"]
    assert not [pid for pid in map(int, note.read_text().split()) if alive(pid)]

    from serving_engines.live import llamacpp_env

    folder = tmp_path / "bin"
    folder.mkdir()
    note.unlink()
    for name in llamacpp_env.TARGETS:
        (folder / name).write_text(HANGING_ENGINE.format(note=note))
        (folder / name).chmod(0o755)
    monkeypatch.setattr(llamacpp_env, "VERSION_TIMEOUT_S", 2)
    engine = doctor(capsys, tmp_path, "--llamacpp-bin", folder)["engines"]["llamacpp"]
    assert engine["found"] is False and "did not answer within 2 s" in engine["problem"]
    assert not [pid for pid in map(int, note.read_text().split()) if alive(pid)]


def test_doctor_reads_an_engine_version_that_is_not_utf8(tmp_path, capsys):
    folder = tmp_path / "bin"
    folder.mkdir()
    from serving_engines.live.llamacpp_env import TARGETS

    for name in TARGETS:
        (folder / name).write_bytes(b"#!/bin/sh\nprintf 'version: 7 (build 11434) \\377\\376 caf\\351\\n'\n")
        (folder / name).chmod(0o755)
    engine = doctor(capsys, tmp_path, "--llamacpp-bin", folder)["engines"]["llamacpp"]
    assert engine["found"] is True and "build 11434" in engine["version"], engine
    python = tmp_path / "python"
    python.write_bytes(b"#!/bin/sh\nprintf 'no module named \\377vllm\\n' >&2\nexit 1\n")
    python.chmod(0o755)
    engine = doctor(capsys, tmp_path, "--vllm-python", python)["engines"]["vllm-python"]
    assert engine["found"] is False and "fails: no module named" in engine["problem"], engine

"""Running the traced command: as a child process with the bootstrap first on its PYTHONPATH (what the verb does,
torchrun and accelerate included), or a Python script in this process (`record_script`, for tests and benches)."""

from __future__ import annotations

import json
import os
import runpy
import subprocess
import sys
import threading
from collections import deque
from pathlib import Path

from dflash_audit import trace as entry
from dflash_audit.trace.recording import MANIFEST, read_error
from foundation.errors import AuditError

BOOTSTRAP = Path(__file__).resolve().parent / "bootstrap"
REPO = Path(__file__).resolve().parents[2]


def trace_env(out: Path, steps: int, target: Path | None, drafter_class: str | None, env=None) -> dict:
    env = dict(os.environ if env is None else env)
    env[entry.ENV_OUT] = str(Path(out).resolve())
    env[entry.ENV_OPTIONS] = json.dumps({"steps": steps, "target": str(target) if target else None,
                                          "drafter_class": drafter_class})
    env["PYTHONPATH"] = os.pathsep.join([str(BOOTSTRAP), str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    return env


def run_command(command: list[str], out: Path, steps: int = 1, target: Path | None = None,
                drafter_class: str | None = None) -> None:
    """Run COMMAND under the recorder; raise AuditError (one line) unless it left a recording in `out`."""
    if not command:
        raise AuditError("give the training command after --, e.g. dflash-audit trace -- python train.py")
    env = trace_env(out, steps, target, drafter_class)
    last: deque[str] = deque(maxlen=20)
    try:
        process = subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True, errors="replace")
    except OSError as exc:
        raise AuditError(f"{command[0]}: cannot run it ({exc.strerror or exc})") from None

    def forward() -> None:  # the script's stderr still reaches the user; its last lines are kept for the error
        for line in process.stderr:
            sys.stderr.write(line)
            if line.strip():
                last.append(line.rstrip())

    reader = threading.Thread(target=forward, daemon=True)
    reader.start()
    status = process.wait()
    reader.join(timeout=5)
    check_outcome(out, status, list(last), " ".join(command))


def check_outcome(out: Path, status: int, stderr_tail: list[str], what: str) -> None:
    refused = read_error(out)
    if refused is not None:
        raise AuditError(f"{what}: {refused}")
    if (Path(out) / MANIFEST).is_file() and status == 0:
        return
    if status != 0:
        tail = stderr_tail[-1] if stderr_tail else "(nothing on stderr)"
        raise AuditError(f"{what}: exited with status {status} before a step was recorded; its last stderr line: "
                         f"{tail[:300]}")
    raise AuditError(f"{what}: finished without calling trace.step(loss): add `from dflash_audit import trace` and "
                     "`trace.step(loss)` once the step's loss exists")


def record_script(script: Path, argv: list[str], out: Path, steps: int = 1, target: Path | None = None,
                  drafter_class: str | None = None) -> None:
    """Run a Python training script in this process under the recorder (the same hooks as the bootstrap)."""
    from dflash_audit.trace.recorder import Recorder, TraceStop

    recorder = Recorder(Path(out), steps=steps, target=str(target) if target else None,
                        drafter_class=drafter_class).install()
    saved_argv = sys.argv
    sys.argv = [str(script), *argv]
    status = 0
    try:
        runpy.run_path(str(script), run_name="__main__")
        recorder.finish()
    except TraceStop as stop:
        status = int(stop.code or 0)
    except SystemExit as exc:
        status = exc.code if isinstance(exc.code, int) else 1
    finally:
        sys.argv = saved_argv
        recorder.remove()
    check_outcome(out, status if status != 3 else 0, [], str(script))

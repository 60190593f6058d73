"""Running the traced command: as a child process with the bootstrap first on its PYTHONPATH (what the verb does,
torchrun and accelerate included), or a Python script in this process (`record_script`, for tests and benches)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import runpy
import subprocess
import sys
import threading
from collections import deque
from pathlib import Path
from typing import TYPE_CHECKING

from dflash_audit.trace.recording import ENV_OPTIONS, ENV_OUT, MANIFEST, read_error
from foundation.errors import CLASS_NAME, AuditError

BOOTSTRAP = Path(__file__).resolve().parent / "bootstrap"
REPO = Path(__file__).resolve().parents[2]

if TYPE_CHECKING:
    from dflash_audit.flags.trace import TraceFlags


def trace_env(out: Path, steps: int, target: Path | None, drafter_class: str | None, env=None,
              evaluation: bool = False, parity: int = 0) -> dict:
    env = dict(os.environ if env is None else env)
    env[ENV_OUT] = str(Path(out).resolve())
    env[ENV_OPTIONS] = json.dumps({"steps": steps, "target": str(target) if target else None,
                                   "drafter_class": drafter_class, "evaluation": evaluation, "parity": parity})
    env["PYTHONPATH"] = os.pathsep.join([str(BOOTSTRAP), str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    return env


def run_command(command: list[str], out: Path, steps: int = 1, target: Path | None = None,
                drafter_class: str | None = None, evaluation: bool = False, parity: int = 0) -> None:
    """Run COMMAND under the recorder; raise AuditError (one line) unless it left a recording in `out`."""
    if not command:
        raise AuditError("give the training command after --, e.g. dflash-audit trace -- python train.py")
    env = trace_env(out, steps, target, drafter_class, evaluation=evaluation, parity=parity)
    last: deque[str] = deque(maxlen=20)
    printed: deque[str] = deque(maxlen=50)
    try:
        process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                   errors="replace")
    except OSError as exc:
        raise AuditError(f"{command[0]}: cannot run it ({exc.strerror or exc})") from None

    def forward() -> None:  # the script's stderr still reaches the user; its last lines are kept for the error
        for line in process.stderr:
            sys.stderr.write(line)
            if line.strip():
                last.append(line.rstrip())

    def forward_out() -> None:  # its stdout too; the last lines kept for the τ an evaluator prints
        for line in process.stdout:
            sys.stdout.write(line)
            if line.strip():
                printed.append(line.rstrip())

    reader = threading.Thread(target=forward, daemon=True)
    out_reader = threading.Thread(target=forward_out, daemon=True)
    reader.start()
    out_reader.start()
    status = process.wait()
    reader.join(timeout=5)
    out_reader.join(timeout=5)
    check_outcome(out, status, list(last), " ".join(command))
    keep_printed_tau(out, list(printed))


def keep_printed_tau(out: Path, lines: list[str]) -> None:
    """An evaluation's τ as its script printed it (when it hands none over with `trace.tau`), kept beside it."""
    from dflash_audit.trace.eval_record import has_evaluation, note_printed_tau

    if has_evaluation(out):
        note_printed_tau(out, lines)


def ended(status: int) -> str:
    """How a command ended, in words: a negative status is the signal that killed it (subprocess' convention)."""
    if status >= 0:
        return f"exited with status {status}"
    import signal

    try:
        name = signal.Signals(-status).name
    except ValueError:
        return f"was killed by signal {-status}"
    return f"was killed by signal {-status} ({name})"


def check_outcome(out: Path, status: int, stderr_tail: list[str], what: str) -> None:
    from dflash_audit.trace.eval_record import has_evaluation

    refused = read_error(out)
    if refused is not None:
        raise AuditError(f"{what}: {refused}")
    if ((Path(out) / MANIFEST).is_file() or has_evaluation(out)) and status == 0:
        return
    if status != 0:
        # The script's own words, without the exception's class name (`RuntimeError: CUDA out of memory` is said
        # as what went wrong: the tool's one line never shows a class name).
        tail = CLASS_NAME.sub("", stderr_tail[-1]).strip() if stderr_tail else "(nothing on stderr)"
        raise AuditError(f"{what}: {ended(status)} before a step was recorded; its last stderr line: {tail[:300]}")
    raise AuditError(f"{what}: finished without a training step (no backward() of a loss reaching a trainable "
                     "parameter, and without calling trace.step(loss)) and without an evaluation (no module fed the "
                     "target's features ran after the target)")


def record_script(script: Path, argv: list[str], out: Path, steps: int = 1, target: Path | None = None,
                  drafter_class: str | None = None, evaluation: bool = False, parity: int = 0) -> None:
    """Run a Python training script in this process under the recorder (the same hooks as the bootstrap)."""
    from dflash_audit.trace.recorder import Recorder, TraceStop

    recorder = Recorder(Path(out), steps=steps, target=str(target) if target else None,
                        drafter_class=drafter_class, evaluation=evaluation, parity=parity).install()
    saved_argv, saved_env = sys.argv, os.environ.get(ENV_OUT)
    sys.argv = [str(script), *argv]
    os.environ[ENV_OUT] = str(Path(out).resolve())  # as in the verb's child: `trace.step` hands the loss over
    status = 0
    printed = _Tee(sys.stdout)
    try:
        with contextlib.redirect_stdout(printed):
            runpy.run_path(str(script), run_name="__main__")
        recorder.finish()
    except TraceStop as stop:
        status = int(stop.code or 0)
    except SystemExit as exc:
        status = exc.code if isinstance(exc.code, int) else 1
    finally:
        sys.argv = saved_argv
        if saved_env is None:
            os.environ.pop(ENV_OUT, None)
        else:
            os.environ[ENV_OUT] = saved_env
        recorder.remove()
    check_outcome(out, status if status != 3 else 0, [], str(script))
    keep_printed_tau(out, printed.lines[-50:])


class _Tee(io.TextIOBase):
    """The script's stdout still reaches this process's; its lines are kept."""

    def __init__(self, stream):
        self.stream, self.lines, self.partial = stream, [], ""

    def write(self, text: str) -> int:
        self.stream.write(text)
        self.partial += text
        *done, self.partial = self.partial.split("\n")
        self.lines.extend(line.rstrip() for line in done if line.strip())
        return len(text)

    def flush(self) -> None:
        self.stream.flush()


def check_out(out: Path) -> None:
    """--out holds nothing the tool did not write (a recording or report of its own), and can be written."""
    from dflash_audit.outputs import check_writable
    from dflash_audit.trace.recording import foreign_entries

    if out.exists() and not out.is_dir():
        raise AuditError(f"--out {out}: exists and is not a folder")
    foreign = foreign_entries(out)
    if foreign:
        raise AuditError(f"--out {out}: holds files dflash-audit did not write ({', '.join(foreign[:3])}"
                         f"{'...' if len(foreign) > 3 else ''}); refusing to write there (choose an empty folder)")
    check_writable("--out", out, "dir")


def clear_recording(out: Path) -> None:
    """The tool's own earlier recording in --out, removed before a new one is made (never a user's file)."""
    from dflash_audit.trace.eval_record import OWN_FILES as EVALUATION_FILES
    from dflash_audit.trace.recording import ERROR, MANIFEST, PARITY, TENSORS

    for name in (MANIFEST, ERROR, TENSORS, PARITY, *EVALUATION_FILES):
        (out / name).unlink(missing_ok=True)


def run_trace(flags: TraceFlags):
    """Record the command's first steps into --out (or read --from), audit the recording, write report.json and
    index.html beside it (and --json), as `trace`'s validated flags ask; the TraceReport (an evaluation's report for
    an evaluation, `--eval`)."""
    from dflash_audit.outputs import check_not_foreign, check_writable
    from dflash_audit.trace.audit import audit_recording
    from dflash_audit.trace.recording import read_recording
    from dflash_audit.trace.report import write_report_html, write_report_json

    command, out, from_dir, steps, target = flags.command, flags.out, flags.from_dir, flags.steps, flags.target
    ref, json_path, drafter_class = flags.ref, flags.json_path, flags.drafter_class
    evaluation, drafter, temperature, parity = flags.evaluation, flags.drafter, flags.temperature, flags.parity
    if target is not None and not (Path(target) / "config.json").is_file():
        raise AuditError(f"--target {target}: no Hugging Face model folder there (config.json missing)")
    if ref is not None and not Path(ref).exists():
        raise AuditError(f"--ref {ref}: no such file or folder")
    if from_dir is not None:
        folder = Path(from_dir)
    else:
        folder = Path(out or "reports/trace")
        check_out(folder)
        created = not folder.exists()
        clear_recording(folder)
        try:
            run_command(command, folder, steps, target, drafter_class, evaluation, parity)
        except AuditError:  # a command that failed leaves nothing behind: its partial recording, the folder made
            clear_recording(folder)
            if created:
                with contextlib.suppress(OSError):
                    folder.rmdir()
            raise
    report_dir = Path(out) if out is not None else folder
    if report_dir != folder:
        check_out(report_dir)
    if json_path is not None:
        check_writable("--json", json_path)
        check_not_foreign("--json", json_path, False)
    from dflash_audit.trace.eval_record import has_evaluation

    if has_evaluation(folder) and not (folder / "manifest.json").is_file():
        from dflash_audit.trace.evaluation import audit_evaluation_folder

        return audit_evaluation_folder(folder, report_dir, "--from" if from_dir is not None else "--out", target,
                                       drafter, temperature, json_path, flags.tau_bin_tokens)
    report = audit_recording(read_recording(folder, "--from" if from_dir is not None else "--out"), target, ref)
    write_report_json(report, report_dir / "report.json")
    write_report_html(report, report_dir / "index.html")
    if json_path is not None:
        write_report_json(report, json_path)
    return report

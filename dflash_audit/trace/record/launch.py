"""Running the traced command: as a child process with the bootstrap first on its PYTHONPATH (what the verb does,
torchrun and accelerate included), or a Python script in this process (`record_script`, for tests and benches)."""

from __future__ import annotations

import contextlib
import io
import os
import runpy
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from dflash_audit.trace.record.marks import Mark, marked
from dflash_audit.trace.record.options import RecorderOptions
from dflash_audit.trace.record.recording import ENV_OUT, MANIFEST, read_error
from foundation.errors import CLASS_NAME, AuditError

BOOTSTRAP = Path(__file__).resolve().parent / "bootstrap"
REPO = Path(__file__).resolve().parents[3]


def trace_env(options: RecorderOptions, marks: Path | None = None, env=None) -> dict:
    """The traced command's environment: the recorder's options, the folder for its marks, and the bootstrap first
    on its PYTHONPATH."""
    env = options.environment(dict(os.environ if env is None else env), marks)
    env["PYTHONPATH"] = os.pathsep.join([str(BOOTSTRAP), str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    return env


def run_command(command: list[str], options: RecorderOptions, timeout_s: float | None = None) -> None:
    """Run COMMAND under the recorder, in its own process group (traced_process.py); raise AuditError (one line)
    unless it left a recording in `options.out`."""
    from dflash_audit.trace.record.traced_process import run_in_group

    if not command:
        raise AuditError("give the training command after --, e.g. dflash-audit trace -- python train.py")
    what = " ".join(command)
    with tempfile.TemporaryDirectory(prefix="dflash-audit-trace-") as folder:
        marks = Path(folder)
        ended = run_in_group(command, trace_env(options, marks), what, timeout_s,
                             begun=lambda: bool(marked(marks, Mark.STEPPED)))
        check_outcome(options.out, ended.status, ended.stderr_tail, what, Progress.read(marks), options, command)
    keep_printed_tau(options.out, ended.stdout_tail)


@dataclass(frozen=True)
class Progress:
    """How far the traced command's processes got, from the recorder's marks (marks.py)."""

    installed: frozenset[int]
    failed: dict[int, str]  # pid -> why the recorder could not be installed there
    stepped: frozenset[int]
    exited: frozenset[int]

    @classmethod
    def read(cls, marks: Path) -> Progress:
        return cls(frozenset(marked(marks, Mark.INSTALLED)), marked(marks, Mark.INSTALL_FAILED),
                   frozenset(marked(marks, Mark.STEPPED)), frozenset(marked(marks, Mark.EXITED)))


def keep_printed_tau(out: Path, lines: list[str]) -> None:
    """An evaluation's τ as its script printed it (when it hands none over with `trace.tau`), kept beside it."""
    from dflash_audit.trace.evaluation.recorder import has_evaluation, note_printed_tau

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


def no_step_nor_round(what: str, evaluation: bool) -> AuditError:
    """A command that took no training step and ran no evaluation round; under --eval, most likely a trainer."""
    rounds = "no module fed the target's features ran after the target, the target verifying its output"
    if evaluation:
        return AuditError(f"{what}: ran no evaluation round under --eval ({rounds}); --eval ignores its backwards: "
                          "a trainer is traced without --eval")
    return AuditError(f"{what}: finished without a training step (no backward() of a loss reaching a trainable "
                      f"parameter, and without calling trace.step(loss)) and without an evaluation round ({rounds})")


def check_outcome(out: Path, status: int, stderr_tail: list[str], what: str, progress: Progress | None = None,
                  options: RecorderOptions | None = None, command: list[str] | None = None) -> None:
    """Nothing to say when the command left a recording and exited 0; else the one line that says what happened,
    read from the recorder's refusal, the command's status and, for a traced command, the recorder's marks."""
    from dflash_audit.trace.evaluation.recorder import has_evaluation

    refused = read_error(out)
    if refused is not None:  # about a flag of the verb: said as the flag's problem, not the script's
        raise AuditError(refused.message if refused.flag else f"{what}: {refused.message}")
    if ((Path(out) / MANIFEST).is_file() or has_evaluation(out)) and status == 0:
        return
    began = progress is not None and bool(progress.stepped)
    if status != 0:
        # The script's own words, without the exception's class name (`RuntimeError: CUDA out of memory` is said
        # as what went wrong: the tool's one line never shows a class name).
        tail = CLASS_NAME.sub("", stderr_tail[-1]).strip() if stderr_tail else "(nothing on stderr)"
        when = "after its first step began, before the trace ended it" if began else "before a step was recorded"
        raise AuditError(f"{what}: {ended(status)} {when}; its last stderr line: {tail[:300]}")
    if progress is not None:
        not_written = progress.stepped - progress.exited
        if progress.failed and not progress.installed:
            reason = next(iter(progress.failed.values()))
            raise AuditError(f"{what}: the recorder could not be installed in its Python ({reason or 'no reason'}); "
                             "the command ran unrecorded")
        if not progress.installed:
            raise AuditError(f"{what}: ran without the recorder: {bootstrap_skipped(command or [])}; nothing was "
                             "recorded")
        if not_written:
            steps = options.steps if options is not None else 1
            asked = f"when step {steps} ends (--steps {steps}) or " if steps else ""
            raise AuditError(f"{what}: its first step began, but its process ended without Python's normal exit "
                             f"(os._exit, or a signal it did not survive) before the recorder wrote the recording, "
                             f"which it writes {asked}at the script's normal exit; nothing was recorded")
    raise no_step_nor_round(what, options is not None and options.evaluation)


def bootstrap_skipped(command: list[str]) -> str:
    """Why no process of the command installed the recorder, as far as its words tell."""
    how = ("the recorder enters each Python process of the command through a sitecustomize on the PYTHONPATH the "
           "verb sets")
    for index, word in enumerate(command):
        if Path(word).name.startswith("python"):
            skipping = [f"-{letter}" for letter in python_switches(command[index + 1:]) if letter in "IES"]
            if skipping:
                return (f"{Path(word).name} was started with {skipping[0]}, and {how}, which -I and -E ignore (-S "
                        "skips the site hooks)")
    return f"{how}, and none ran it (a Python started with -I, -E or -S, a command that resets PYTHONPATH, or one " \
           "that runs no Python)"


def python_switches(words: list[str]) -> str:
    """The one-letter switches given to Python before its script (`-u -I`, `-Iu`): their letters."""
    letters = ""
    index = 0
    while index < len(words):
        word = words[index]
        if not word.startswith("-") or word.startswith("--") or word == "-":
            break
        for position, letter in enumerate(word[1:], 1):
            if letter in "cm":  # the program follows
                return letters
            if letter in "WX":  # takes a value, attached or the next word
                index += position == len(word) - 1
                break
            letters += letter
        index += 1
    return letters


def record_script(script: Path, argv: list[str], out: Path, steps: int = 1, target: Path | None = None,
                  drafter_class: str | None = None, evaluation: bool = False, parity: int = 0) -> None:
    """Run a Python training script in this process under the recorder (the same hooks, and the same validated
    options, as the bootstrap's)."""
    from dflash_audit.trace.record.recorder import Recorder, TraceStop

    options = RecorderOptions(out=Path(out).resolve(), steps=steps, target=str(target) if target else None,
                              drafter_class=drafter_class, evaluation=evaluation, parity=parity)
    recorder = Recorder.from_options(options).install()
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

"""The `trace` verb: its flags checked whole before any work, the command run under the recorder
(record/launch.py), and what it recorded audited: one training step and the run across steps (step_audit/, run/), or an
evaluator's rounds (evaluation/); the reports written beside the recording."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import TYPE_CHECKING

from dflash_audit.trace.record.launch import no_step_nor_round, run_command
from dflash_audit.trace.record.options import RecorderOptions
from dflash_audit.trace.record.recording import MANIFEST
from foundation.errors import AuditError

if TYPE_CHECKING:
    from dflash_audit.flags.trace import TraceFlags


def check_out(out: Path) -> None:
    """--out holds nothing the tool did not write (a recording or report of its own), and can be written."""
    from dflash_audit.outputs import check_writable
    from dflash_audit.trace.record.recording import foreign_entries

    if out.exists() and not out.is_dir():
        raise AuditError(f"--out {out}: exists and is not a folder")
    foreign = foreign_entries(out)
    if foreign:
        raise AuditError(f"--out {out}: holds files dflash-audit did not write ({', '.join(foreign[:3])}"
                         f"{'...' if len(foreign) > 3 else ''}); refusing to write there (choose an empty folder)")
    check_writable("--out", out, "dir")


def clear_recording(out: Path) -> None:
    """The tool's own earlier recording in --out, removed before a new one is made (never a user's file)."""
    from dflash_audit.trace.evaluation.recorder import OWN_FILES as EVALUATION_FILES
    from dflash_audit.trace.record.recording import ERROR, MANIFEST, PARITY, TENSORS

    for name in (MANIFEST, ERROR, TENSORS, PARITY, *EVALUATION_FILES):
        (out / name).unlink(missing_ok=True)


def check_flags(flags: TraceFlags) -> tuple[Path, Path]:
    """Every flag read whole before any work, the traced command above all (on a real model it costs a full load):
    its input folders and files, and each output written only where it may be. (The recording folder, the report
    folder.)"""
    from dflash_audit.outputs import check_not_foreign, check_writable

    if flags.target is not None and not (Path(flags.target) / "config.json").is_file():
        raise AuditError(f"--target {flags.target}: no Hugging Face model folder there (config.json missing)")
    if flags.ref is not None and not Path(flags.ref).exists():
        raise AuditError(f"--ref {flags.ref}: no such file or folder")
    if flags.ref is not None:  # a config.json declaring what it must, read as the audit reads it
        from dflash_audit.trace.step_audit.reference import read_ref

        read_ref(flags.ref)
    if flags.drafter is not None and not (Path(flags.drafter) / "config.json").is_file():
        raise AuditError(f"--drafter {flags.drafter}: no drafter folder there (config.json missing)")
    if flags.from_dir is None and not flags.command:
        raise AuditError("give the training command after --, e.g. dflash-audit trace -- python train.py")
    folder = Path(flags.from_dir) if flags.from_dir is not None else Path(flags.out or "reports/trace")
    report_dir = Path(flags.out) if flags.out is not None else folder
    if flags.from_dir is None or report_dir != folder:  # a recording re-audited in place: its own folder
        check_out(report_dir)
    if flags.json_path is not None:
        check_writable("--json", flags.json_path)
        check_not_foreign("--json", flags.json_path, False)
    return folder, report_dir


def run_trace(flags: TraceFlags):
    """Record the command's first steps into --out (or read --from), audit the recording, write report.json and
    index.html beside it (and --json), as `trace`'s validated flags ask; the TraceReport (an evaluation's report for
    an evaluation, `--eval`)."""
    folder, report_dir = check_flags(flags)  # torch is imported once the command has run, not before
    if flags.from_dir is None:
        created = not folder.exists()
        clear_recording(folder)
        options = RecorderOptions(out=folder.resolve(), steps=flags.steps,
                                  target=str(flags.target) if flags.target else None,
                                  drafter_class=flags.drafter_class, evaluation=flags.evaluation, parity=flags.parity)
        try:
            run_command(flags.command, options, flags.timeout)
        except AuditError:  # a command that failed leaves nothing behind: its partial recording, the folder made
            clear_recording(folder)
            if created:
                with contextlib.suppress(OSError):
                    folder.rmdir()
            raise
    from dflash_audit.trace.evaluation.recorder import has_evaluation

    source = "--from" if flags.from_dir is not None else "--out"
    if has_evaluation(folder) and not (folder / MANIFEST).is_file():
        from dflash_audit.trace.evaluation.audit import NoRounds, audit_evaluation_folder

        try:
            return audit_evaluation_folder(folder, report_dir, source, flags.target, flags.drafter,
                                           flags.temperature, flags.json_path, flags.tau_bin_tokens)
        except NoRounds:  # for a command just traced: the command's doing, said as such
            if flags.from_dir is not None:
                raise
            raise no_step_nor_round(" ".join(flags.command), flags.evaluation) from None
    from dflash_audit.trace.step_audit.audit import audit_recording
    from dflash_audit.trace.record.recording import read_recording
    from dflash_audit.trace.report import write_report_html, write_report_json

    report = audit_recording(read_recording(folder, source), flags.target, flags.ref)
    write_report_json(report, report_dir / "report.json")
    write_report_html(report, report_dir / "index.html")
    if flags.json_path is not None:
        write_report_json(report, flags.json_path)
    return report

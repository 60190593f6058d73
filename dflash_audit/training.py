"""What `dflash-audit train` runs: its flags validated by pydantic as one model (`TrainFlags`,
dflash_audit/flags/train.py), its paths checked before the tokenizer, the data or the target are read, our trainer run
(`impl/train.py`, also under `torchrun --nproc_per_node=N`) on the run settings the flags give, and its stats written
as JSON."""

from __future__ import annotations

import json
from pathlib import Path

from dflash_audit.flags.train import TrainFlags, flag_refusal
from dflash_audit.outputs import check_not_foreign, check_outputs, check_writable
from foundation.errors import AuditError, SpecError


def check_out(out: Path, resume: bool, force: bool = False) -> None:
    """--out is a checkpoint file: never a directory, never someone else's file; an existing one is
    only this run's own to --resume, or replaced with --force."""
    from dflash_audit.formats import ours

    if out.is_dir():
        raise AuditError(f"--out {out}: a directory; --out is the checkpoint file to write (e.g. {out / 'ckpt.pt'})")
    if out.exists() and out.is_file() and out.suffix != ".pt":
        raise AuditError(f"--out {out}: an existing file that is not a *.pt checkpoint; refusing to overwrite it")
    if resume and out.exists() and not out.is_file():
        raise AuditError(f"--out {out}: not a checkpoint file to --resume from")
    if not out.is_file() or force:
        return
    if not ours.detect(out):
        raise AuditError(f"--out {out}: an existing file that is not a checkpoint dflash-audit wrote; refusing "
                         "to overwrite it (choose another path, or pass --force to replace it)")
    if not resume:
        raise AuditError(f"--out {out}: a checkpoint already exists there; pass --resume to continue that run, "
                         "or --force to replace it")


def check_train_paths(target: Path, data: Path, eval_data: Path | None, out: Path, json_out: Path | None,
                      resume: bool, force: bool = False) -> None:
    """Every path, before the tokenizer, the data or the target are read."""
    from foundation.inputs import check_target_dir, regular_file

    check_target_dir(target)
    regular_file(data, "file", "--data")
    if eval_data is not None:
        regular_file(eval_data, "file", "--eval-data")
    check_outputs({"--out": out, "--json": json_out}, {"--target": target, "--data": data, "--eval-data": eval_data})
    check_out(out, resume, force)
    check_writable("--out", out)
    if json_out is not None:
        check_writable("--json", json_out)
        check_not_foreign("--json", json_out, force)


def run_train(flags: TrainFlags) -> dict:
    """Train as the flags ask; the run's stats (`rank` 0 has written them to `--json`)."""
    from transformers.utils import logging as hf_logging

    from foundation.inputs import regular_file
    from impl.data import DataError
    from impl.run_settings import TrainError
    from impl.train import train as run_training

    # Every flag was judged by its declaration; the recipe resolved, then the paths checked, before the tokenizer,
    # the data or the target are read.
    try:
        settings = flags.run_settings()
    except SpecError as exc:
        raise flag_refusal(exc) from None
    check_train_paths(flags.target, flags.data, flags.eval_data, flags.out, flags.json_out, flags.resume, flags.force)
    if flags.d2t is not None:
        regular_file(flags.d2t, "file", "--d2t")
    hf_logging.disable_progress_bar()  # one progress bar: the trainer's
    try:
        stats = run_training(settings)
    except SpecError as exc:  # a run setting refused against the target or the recipe
        raise flag_refusal(exc) from None
    except (DataError, TrainError) as exc:
        raise AuditError(str(exc)) from exc
    if stats["rank"] == 0 and flags.json_out is not None:  # under torchrun only rank 0 reports
        from foundation.atomic import atomic_write_bytes

        text = json.dumps({"schema": "dflash-audit/train/1", **stats}, indent=2)
        atomic_write_bytes(flags.json_out, lambda tmp: Path(tmp).write_text(text))
    return stats

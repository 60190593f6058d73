"""`dflash-audit doctor [--json]`: what this installation can run (dflash_audit/doctor.py). Exit 0."""

from __future__ import annotations

import json

import typer

from dflash_audit.commands import VERBS
from dflash_audit.flags import register_verb
from dflash_audit.flags.doctor import DoctorFlags


def doctor(flags: DoctorFlags) -> int:
    from dflash_audit.doctor import diagnose, doctor_text

    report = diagnose(flags.vllm_python, flags.llamacpp_bin)
    typer.echo(json.dumps(report, indent=2) if flags.json_output else doctor_text(report))
    return 0


def register(app: typer.Typer) -> None:
    register_verb(app, "doctor", VERBS["doctor"], DoctorFlags, doctor)

"""The one line a training script adds: `from dflash_audit import trace` ... `trace.step(loss)`.

Run without the tool, `step` does nothing, and importing this module imports nothing but the standard library (no
torch). Under `dflash-audit trace -- COMMAND` the environment names the recording folder and a bootstrap installs the
recorder before the script runs (dflash_audit/trace/bootstrap/sitecustomize.py); `step` hands it the step's loss.
"""

from __future__ import annotations

import os

ENV_OUT = "DFLASH_AUDIT_TRACE"  # the recording folder; set only under `dflash-audit trace`
ENV_OPTIONS = "DFLASH_AUDIT_TRACE_OPTIONS"  # JSON: steps, target, drafter_class

recorder = None  # the installed recorder (dflash_audit.trace.recorder.Recorder), None without the tool


def step(loss) -> None:
    """Record this training step (its scalar loss, before `backward`); a no-op without the tool."""
    global recorder
    if recorder is None:
        if not os.environ.get(ENV_OUT):
            return
        from dflash_audit.trace.recorder import install_from_env  # hooks missed this step: it says so

        recorder = install_from_env(late=True)
    recorder.step(loss)

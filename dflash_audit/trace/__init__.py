"""The one line a training script adds: `from dflash_audit import trace` ... `trace.step(loss)`; an evaluator's
optional line: `trace.tau(tau)`, its own τ (a number, or one per prompt).

Run without the tool, `step` does nothing, and importing this module imports no torch (only the standard library
and the recording's file names). Under `dflash-audit trace -- COMMAND` the environment names the recording folder
and a bootstrap installs the recorder before the script runs (dflash_audit/trace/record/bootstrap/sitecustomize.py);
`step` hands it the step's loss.
"""

from __future__ import annotations

import os

from dflash_audit.trace.record.recording import ENV_OUT


def step(loss) -> None:
    """Record this training step (its scalar loss, before `backward`); a no-op without the tool."""
    if not os.environ.get(ENV_OUT):
        return
    from dflash_audit.trace.record.recorder import step_hook

    step_hook(loss)


def tau(value) -> None:
    """Hand over the evaluator's own τ (a number, or a per-prompt list); a no-op without the tool."""
    if not os.environ.get(ENV_OUT):
        return
    from dflash_audit.trace.record.recorder import tau_hook

    tau_hook(value)

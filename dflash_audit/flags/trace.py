"""`trace`'s flags, declared once (`TraceFlags`): its options, `--help` and docs table are generated from them."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from pydantic import AfterValidator, model_validator

from dflash_audit.flags import VerbFlags, flag, tau_bin_flag


def module_and_class(value: str) -> str:
    """MODULE:CLASS as the recorder looks it up in the traced script (a dotted module name as the script imports it,
    a class name in it): anything else could never name a class there."""
    module, colon, name = value.partition(":")
    if not (module and colon and name and all(part.isidentifier() for part in module.split("."))
            and name.isidentifier()):
        raise ValueError(f"give MODULE:CLASS, e.g. dflash.model:DFlashDraftModel (a class of the script itself: "
                         f"__main__:NAME), got {value!r}")
    return value


class TraceFlags(VerbFlags):
    """`trace`'s flags, and the command after `--`."""

    target: Path | None = flag(None, help="the target's HF folder, when the script loads more than one model "
                                          "(default: the one it ran)")
    steps: int = flag(1, ge=0, help="training steps to record, then end the script (0: let it finish)")
    ref: Path | None = flag(None, help="a config.json declaring the reference's target_layer_ids / block_size / "
                                       "mask_token_id")
    out: Path | None = flag(None, help="recording and report folder (default reports/trace)")
    json_path: Path | None = flag(None, "--json", help="also write report.json here")
    drafter_class: Annotated[str, AfterValidator(module_and_class)] | None = flag(
        None, help="MODULE:CLASS of the drafter, when the loss trains several modules")
    from_dir: Path | None = flag(None, "--from", help="re-audit this recording (no command)")
    evaluation: bool = flag(False, "--eval", help="the command is an evaluation (a run with no backward is one "
                                                  "anyway): its backwards are ignored")
    drafter: Path | None = flag(None, help="an evaluation's drafter folder (z-lab format), when its module does not "
                                           "name one")
    temperature: float | None = flag(None, ge=0, le=100.0, help="an evaluation's sampling temperature, when it "
                                                                "samples (default: greedy)")
    tau_bin_tokens: int = tau_bin_flag()
    parity: int = flag(0, ge=0, help="run speculators' own training step (its model, its loss, its optimizers) "
                                     "beside the first K recorded steps, from their weights and batches, and name "
                                     "the first step and phase where they part (K < --steps)")
    timeout: float | None = flag(None, gt=0, help="seconds the command may take to reach its first training step "
                                                  "(or evaluation round); past them it is stopped with every process "
                                                  "it started (default: no bound)")
    command: list[str] = flag([], arguments=True, help="your own training command, after `--`")

    @model_validator(mode="after")
    def a_command_or_a_recording(self) -> TraceFlags:
        if self.from_dir is not None and self.command:
            raise ValueError("--from re-audits a recording: give it without a command")
        if self.from_dir is not None and self.timeout is not None:
            raise ValueError("--timeout bounds a traced command: --from runs none")
        if self.parity and self.steps and self.parity >= self.steps:
            raise ValueError(f"--parity {self.parity}: give fewer steps than --steps {self.steps} (each compared step "
                             "needs the weights of the step after it)")
        return self

"""`dflash-audit trace -- COMMAND`: record a team's own training step, or its own evaluation, and audit it."""

from __future__ import annotations

from pathlib import Path

import typer

from dflash_audit.commands import VERBS


def register(app: typer.Typer) -> None:
    @app.command("trace", help=VERBS["trace"],
                 context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
    def trace(
        ctx: typer.Context,
        target: Path | None = typer.Option(None, "--target", help="the target's HF folder, when the script loads "
                                                                   "more than one model (default: the one it ran)"),
        steps: int = typer.Option(1, "--steps", help="training steps to record, then end the script (0: let it "
                                                     "finish)"),
        ref: Path | None = typer.Option(None, "--ref", help="a config.json declaring the reference's "
                                                            "target_layer_ids / block_size / mask_token_id"),
        out: Path | None = typer.Option(None, "--out", help="recording and report folder (default reports/trace)"),
        json_path: Path | None = typer.Option(None, "--json", help="also write report.json here"),
        drafter_class: str | None = typer.Option(None, "--drafter-class",
                                                 help="MODULE:CLASS of the drafter, when the loss trains several "
                                                      "modules"),
        from_dir: Path | None = typer.Option(None, "--from", help="re-audit this recording (no command)"),
        evaluation: bool = typer.Option(False, "--eval", help="the command is an evaluation (a run with no "
                                                              "backward is one anyway): its backwards are ignored"),
        drafter: Path | None = typer.Option(None, "--drafter", help="an evaluation's drafter folder (z-lab format), "
                                                                    "when its module does not name one"),
        temperature: float | None = typer.Option(None, "--temperature", help="an evaluation's sampling temperature, "
                                                                              "when it samples (default: greedy)"),
    ) -> int:
        from dflash_audit.trace.report import terminal_summary
        from dflash_audit.trace.run import run_trace

        report = run_trace(list(ctx.args), out, from_dir, steps, target, ref, json_path, drafter_class, evaluation,
                           drafter, temperature)
        if hasattr(report, "summary"):  # an evaluation's report (dflash_audit/trace/evaluation.py)
            typer.echo(report.summary())
            return report.exit_status
        typer.echo(terminal_summary(report))
        return report.exit_status

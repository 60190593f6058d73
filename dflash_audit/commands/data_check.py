"""`dflash-audit data-check DIR --target T [--layer-ids IDS | --drafter D]`: an offline hidden-state dataset (vLLM's
extract_hidden_states, speculators' hs_i.safetensors, SpecForge's pickled records) named by value against the target
recomputed on its own token ids (dflash_audit/data_check/). Exit 0 none, 1 divergences, 2 trouble. Every option's
default and help are `DataCheckSettings`' declarations (dflash_audit/data_check/run.py)."""

from __future__ import annotations

from pathlib import Path

import typer

from dflash_audit.commands import VERBS
from dflash_audit.data_check.run import DataCheckSettings, option


def register(app: typer.Typer) -> None:
    fields = DataCheckSettings.model_fields

    @app.command("data-check", help=VERBS["data-check"])
    def data_check(
        dataset: Path = typer.Argument(..., help=fields["dataset"].description),
        target: Path = typer.Option(..., "--target", help=fields["target"].description),
        layer_ids: str | None = option("layer_ids"),
        drafter: Path | None = option("drafter"),
        records: int = option("records"),
        device: str = option("device"),
        dtype: str = option("dtype"),
        chat_template: str = option("chat_template"),
        chat_template_kwargs: str | None = option("chat_template_kwargs"),
        out: Path | None = option("out"),
        json_path: Path | None = typer.Option(None, "--json", help=fields["json_path"].description),
        force: bool = option("force"),
    ) -> int:
        from dflash_audit.data_check.report import terminal_summary
        from dflash_audit.data_check.run import run_data_check

        settings = DataCheckSettings(dataset=dataset, target=target, layer_ids=layer_ids, drafter=drafter,
                                     records=records, device=device, dtype=dtype, chat_template=chat_template,
                                     chat_template_kwargs=chat_template_kwargs, out=out, json_path=json_path,
                                     force=force)
        report = run_data_check(settings)
        typer.echo(terminal_summary(report))
        return report.exit_status

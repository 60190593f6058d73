"""`dflash-audit demo`: build the embedded world once, then audit its planted-bug drafter."""

from __future__ import annotations

from pathlib import Path

import typer

from dflash_audit.commands import VERBS
from dflash_audit.demo import DemoConfig, run_demo
from foundation.placement import DEVICE_HELP, DTYPE_HELP


def register(app: typer.Typer) -> None:
    @app.command("demo", help=VERBS["demo"])
    def demo(
        world_dir: Path | None = typer.Option(None, "--world-dir",
                                              help="the demo world's folder (default <cache-dir>/demo)"),
        # The old name of --world-dir, kept working but unlisted: --cache reads as a cache root elsewhere.
        old_world_dir: Path | None = typer.Option(None, "--cache", hidden=True, help="deprecated: --world-dir"),
        cache_dir: Path | None = typer.Option(None, "--cache-dir",
                                              help="cache root (default $XDG_CACHE_HOME/dflash-audit)"),
        rebuild: bool = typer.Option(False, "--rebuild", help="retrain everything in the cache"),
        out: Path | None = typer.Option(None, "--out", help="report directory (default reports/demo, "
                                                            "reports/demo-dflash2 for --family dflash2)"),
        family: str = typer.Option("dflash", "--family",
                                   help="dflash, or dflash2: the second act, the same story on a DFlash2 pair"),
        device: str = typer.Option("auto", "--device", help=DEVICE_HELP),
        dtype: str = typer.Option("auto", "--dtype", help=DTYPE_HELP + "; a comma list measures τ in each"),
    ) -> int:
        run_demo(world_dir or old_world_dir, rebuild, out, cache_dir=cache_dir, config=DemoConfig(family=family),
                 device=device, dtype=dtype, trace_trainer=True)
        # Finding the planted divergences is the demo's point: compare's exit status 1
        # ("divergences found") is success here; trouble still raises and exits 2.
        return 0

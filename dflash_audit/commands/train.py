"""`dflash-audit train`: our online DFlash trainer (also under `torchrun --nproc_per_node=N`). Its flags are
`TrainFlags` (dflash_audit/flags/train.py: each run setting's flag generated from its declaration), handed to
`run_train` (dflash_audit/training.py) whole."""

from __future__ import annotations

import typer

from dflash_audit.commands import VERBS
from dflash_audit.flags import register_verb
from dflash_audit.flags.train import TrainFlags


def train(flags: TrainFlags) -> int:
    from dflash_audit.training import run_train

    stats = run_train(flags)
    if stats["rank"] == 0:  # under torchrun only rank 0 reports
        final = stats["eval"] or stats["final"]
        typer.echo(f"trained {stats['steps']} steps in {stats['seconds']} s -> {stats['out']}  "
                   f"loss {final['loss']:.4f}  EAL {final['eal']:.2f}")
    return 0


def register(app: typer.Typer) -> None:
    register_verb(app, "train", VERBS["train"], TrainFlags, train)

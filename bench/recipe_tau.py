"""τ of the test world's DFlash drafter against the same drafter trained with speculators' run (Muon on the 2-D
weights + AdamW, lr 1e-3, linear schedule warming up over 1% of the steps, clip 1.0: `train --recipe speculators`'s
optimizer and schedule), the world's loss (KL, fixed decay) and everything else unchanged (`dflash_world/drafter.py`
TEST_DRAFTER, 400 steps). Both decode the world's 8 held-out prompts (`dflash-audit eval --max-new-tokens 96`).

    python bench/recipe_tau.py OUT_FOLDER    # trains into OUT_FOLDER/speculators-run.pt, then evaluates both

Run on 2 shared CPU cores 2026-12-02: about 4 min 20 s of training; mean τ 3.293 (the world's drafter) against 2.173
(speculators' run), docs/training.md.
"""

from __future__ import annotations

import sys
from pathlib import Path

from reference_adapters.speculators_run_recipe import train_run_settings


def main(out: Path) -> None:
    from dflash_audit.cli import main as cli
    from dflash_world import cached_test_world
    from dflash_world.corpus import stdlib_corpus
    from dflash_world.drafter import TEST_DRAFTER, cached_test_drafter
    from impl.train import train_drafter

    world = cached_test_world()
    out.mkdir(parents=True, exist_ok=True)
    after = out / "speculators-run.pt"
    if not after.is_file():
        settings = {**TEST_DRAFTER, "loss_fn": "kl_div", **train_run_settings("dflash")}
        train_drafter(world.target, stdlib_corpus("train", max_bytes=1_000_000), after, **settings)
    for drafter in (cached_test_drafter(world), after):
        print(f"== {drafter}")
        cli(["eval", "--drafter", str(drafter), "--target", str(world.target), "--prompts",
             str(world.prompts), "--max-new-tokens", "96"])


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python bench/recipe_tau.py OUT_FOLDER")
    main(Path(sys.argv[1]))

"""A drafter trained briefly on a world's corpus, built once per world and shared by the test suites.

Random drafters accept nothing (τ = 1 everywhere) and prove nothing about decoding, so
every test that compares acceptance lengths uses this one trained pair.
"""

from __future__ import annotations

import fcntl
from pathlib import Path

from .cache import WorldPaths
from .corpus import stdlib_corpus

# Two draft layers (one sliding, window below the sequence length, one full) reading three target layers.
# A fixed step count, never a time budget: the same drafter (and τ) on every machine.
TEST_DRAFTER = dict(steps=400, max_anchors=48, block_size=8, draft_layers=2, fc_layers=[1, 2, 3],
                    layer_types=["sliding_attention", "full_attention"], sliding_window=48, seq_len=256,
                    batch_size=4, lr=3e-3, warmup=20, progress=False)


def cached_test_drafter(world: WorldPaths) -> Path:
    """`<world>/test-drafter.pt`, trained by `impl.train` on first use."""
    from impl.train import train_drafter

    path = world.root / "test-drafter.pt"
    with open(world.root / ".test-drafter.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # parallel test processes train it once
        if not path.is_file():
            train_drafter(world.target, stdlib_corpus("train", max_bytes=1_000_000), path, **TEST_DRAFTER)
    return path

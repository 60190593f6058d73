"""Drafters trained briefly on a world's corpus, built once per world and shared by the test suites.

Random drafters accept nothing (τ = 1 everywhere) and prove nothing about decoding, so
every test that compares acceptance lengths uses these trained drafters.

Two losses, two kinds of drafter. The KL-trained one (speculators' default) copies the
weak target's flat distributions: its argmax chain is often right, but its per-depth
probabilities are low (top-1 ~0.03), so a best-first tree spends its budget on depth-1
siblings. The CE-trained one (hard labels: the target's argmax) is confident, the regime
DDTree is built for and the one the published drafters are in.
"""

from __future__ import annotations

from pathlib import Path

from foundation.cache_dir import build_once
from impl.recipe import DEFAULTS

from .world_cache import WorldPaths
from .corpus import stdlib_corpus

# Two draft layers (one sliding, window below the sequence length, one full) reading three target layers.
# A fixed step count, never a time budget: the same drafter (and τ) on every machine.
TEST_DRAFTER = dict(steps=400, max_anchors=48, block_size=8, draft_layers=2, target_layer_ids=[1, 2, 3],
                    layer_types=["sliding_attention", "full_attention"], sliding_window=48, seq_len=256,
                    batch_size=4, lr=3e-3, warmup=20, progress=False,
                    # Pinned: the trainer now defaults to D-PACE; these drafters keep their fixed-decay training.
                    per_position_loss_weight="fixed-exp-decay", gamma=DEFAULTS["gamma"])
DRAFTER_FILES = {"kl_div": "test-drafter.pt", "ce": "test-drafter-ce.pt"}
# The DFlash2 twin: the same run with convolutions and a selector, speculators' dflash2 loss (KL, fixed decay)
# and its bidirectional sliding windows; a small selector, sized for the tiny world.
DFLASH2_DRAFTER = dict(TEST_DRAFTER, family="dflash2", conv_kernel_size=2, conv_group_size=16, selector_rank=32,
                       selector_top_k=8, loss_fn="kl_div")
DFLASH2_DRAFTER_FILE = "test-drafter-dflash2.pt"
# The all-full-attention twin, for the live vLLM check: vLLM's CPU (V1) runner refuses drafters that mix sliding
# and full layers, so the served drafter is the same recipe with both layers full.
FULL_DRAFTER = dict(TEST_DRAFTER, layer_types=["full_attention", "full_attention"], sliding_window=None)
FULL_DRAFTER_FILE = "test-drafter-full.pt"


def cached_test_drafter(world: WorldPaths, loss: str = "kl_div") -> Path:
    """`<world>/test-drafter.pt` (or `test-drafter-ce.pt`), trained by `impl.train` on first use."""
    from impl.train import train_drafter

    if loss not in DRAFTER_FILES:
        raise ValueError(f"loss_fn must be one of {sorted(DRAFTER_FILES)}, not {loss!r}")
    path = world.root / DRAFTER_FILES[loss]

    def train() -> Path:
        train_drafter(world.target, stdlib_corpus("train", max_bytes=1_000_000), path, **TEST_DRAFTER, loss_fn=loss)
        return path

    return build_once(world.root / f".{path.stem}.lock", lambda: path if path.is_file() else None, train)


def cached_dflash2_drafter(world: WorldPaths) -> Path:
    """`<world>/test-drafter-dflash2.pt`: the DFlash2 test drafter, trained by `impl.train` on first use."""
    from impl.train import train_drafter

    path = world.root / DFLASH2_DRAFTER_FILE

    def train() -> Path:
        train_drafter(world.target, stdlib_corpus("train", max_bytes=1_000_000), path, **DFLASH2_DRAFTER)
        return path

    return build_once(world.root / f".{path.stem}.lock", lambda: path if path.is_file() else None, train)


def cached_full_drafter(world: WorldPaths) -> Path:
    """`<world>/test-drafter-full.pt`: the all-full-attention test drafter (vLLM's CPU runner serves it)."""
    from impl.train import train_drafter

    path = world.root / FULL_DRAFTER_FILE

    def train() -> Path:
        train_drafter(world.target, stdlib_corpus("train", max_bytes=1_000_000), path, **FULL_DRAFTER, loss_fn="kl_div")
        return path

    return build_once(world.root / f".{path.stem}.lock", lambda: path if path.is_file() else None, train)

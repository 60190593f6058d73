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

from .corpus import stdlib_corpus
from .kernel_pins import run_pinned
from .long_context import cached_long_target, long_target_dir
from .world_cache import WorldPaths

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


# The long-context pair, trained against the long target (long_context.py) on its 256-token rows as the others: the
# mixed sliding/full drafter (llama.cpp serves it; the offline audit runs it) and its all-sliding twin (vLLM's CPU
# runner refuses a mix). Past 256 positions both run beyond the length they were trained on, as the marks say.
LONG_DRAFTER = dict(TEST_DRAFTER, loss_fn="kl_div")
SLIDING_DRAFTER = dict(LONG_DRAFTER, layer_types=["sliding_attention", "sliding_attention"])

# Every test drafter by name: its file in the world's folder and its training run.
DRAFTERS = {"kl_div": (DRAFTER_FILES["kl_div"], dict(TEST_DRAFTER, loss_fn="kl_div")),
            "ce": (DRAFTER_FILES["ce"], dict(TEST_DRAFTER, loss_fn="ce")),
            "dflash2": (DFLASH2_DRAFTER_FILE, DFLASH2_DRAFTER),
            "full": (FULL_DRAFTER_FILE, dict(FULL_DRAFTER, loss_fn="kl_div")),
            "long": ("test-drafter-long.pt", LONG_DRAFTER),
            "long-sliding": ("test-drafter-long-sliding.pt", SLIDING_DRAFTER)}
# The drafters trained against the long target; every other one against the test target.
LONG_TARGET_DRAFTERS = frozenset({"long", "long-sliding"})


def train_named_drafter(world: WorldPaths, name: str) -> Path:
    """Train the drafter `name` into the world's folder, in this process (`pinned_build`'s job: the caller holds
    the build lock and the kernel pins)."""
    from impl.train import train_drafter

    file, settings = DRAFTERS[name]
    path = world.root / file
    target = long_target_dir(world) if name in LONG_TARGET_DRAFTERS else world.target
    train_drafter(target, stdlib_corpus("train", max_bytes=1_000_000), path, **settings)
    return path


def cached_drafter(world: WorldPaths, name: str) -> Path:
    """`<world>/<file of name>`, trained on first use under the kernel pins (a child process: kernel_pins.py),
    whatever this process's own kernels."""
    path = world.root / DRAFTERS[name][0]

    def train() -> Path:
        if name in LONG_TARGET_DRAFTERS:
            cached_long_target(world)
        run_pinned({"what": "drafter", "root": str(world.root), "name": name})
        return path

    return build_once(world.root / f".{path.stem}.lock", lambda: path if path.is_file() else None, train)


def cached_test_drafter(world: WorldPaths, loss: str = "kl_div") -> Path:
    """`<world>/test-drafter.pt` (or `test-drafter-ce.pt`)."""
    if loss not in DRAFTER_FILES:
        raise ValueError(f"loss_fn must be one of {sorted(DRAFTER_FILES)}, not {loss!r}")
    return cached_drafter(world, loss)


def cached_dflash2_drafter(world: WorldPaths) -> Path:
    """`<world>/test-drafter-dflash2.pt`: the DFlash2 test drafter."""
    return cached_drafter(world, "dflash2")


def cached_full_drafter(world: WorldPaths) -> Path:
    """`<world>/test-drafter-full.pt`: the all-full-attention test drafter (vLLM's CPU runner serves it)."""
    return cached_drafter(world, "full")


def cached_long_drafter(world: WorldPaths, sliding_only: bool = False) -> Path:
    """`<world>/test-drafter-long.pt` (sliding + full) or `test-drafter-long-sliding.pt`, both against the long
    target."""
    return cached_drafter(world, "long-sliding" if sliding_only else "long")

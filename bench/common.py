"""Shared setup of the benchmarks: the world, the checkpoints, z-lab's loop, the report file.

Run from the repository root (`python bench/<name>.py`); defaults use the test world and
drafters trained briefly on its corpus by our trainer, cached next to the world.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import time
from pathlib import Path

import torch

from dflash_audit.prompts import load_prompts, tokenize_prompts
from foundation.atomic import atomic_write_bytes
from foundation.target import load_target
from impl.body_shapes import build_drafter
from reference_adapters.zlab_adapter import zlab_generate, zlab_twin  # noqa: F401  (used by the bench scripts)

REPORT_DIR = Path("reports") / "bench"
# Two checkpoints of the "compare many checkpoints" scenario: a sound recipe and a planted
# bug (fc fed fewer layers, shorter training). Both train within ~2 minutes on 2 CPU cores.
BENCH_DRAFTERS = {
    "sound": dict(steps=600, max_anchors=48, block_size=8, draft_layers=2, target_layer_ids=[1, 2, 3],
                  layer_types=["sliding_attention", "full_attention"], sliding_window=48),
    "planted": dict(steps=300, max_anchors=48, block_size=8, draft_layers=2, target_layer_ids=[1, 2],
                    layer_types=["sliding_attention", "full_attention"], sliding_window=48),
}
# The loss pinned to what these drafters were measured with (the trainer now defaults to CE + D-PACE).
COMMON_TRAINING = dict(seq_len=256, batch_size=4, lr=3e-3, warmup=20, progress=False, loss_fn="kl_div",
                       per_position_loss_weight="fixed-exp-decay", gamma=4.0)


def trained_drafter(world, name: str, settings: dict | None = None) -> Path:
    """`<world>/bench-drafter-<name>.pt`, trained once on the world's corpus with `BENCH_DRAFTERS[name]` (or
    `settings`) and `COMMON_TRAINING`."""
    from dflash_world import stdlib_corpus
    from impl.train import train_drafter

    path = world.root / f"bench-drafter-{name}.pt"
    with open(world.root / f".bench-drafter-{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not path.is_file():
            train_drafter(world.target, stdlib_corpus("train", max_bytes=1_000_000), path,
                          **(settings or BENCH_DRAFTERS[name]), **COMMON_TRAINING)
    return path


def parse_args(description: str, default_out: str, extra=None) -> argparse.Namespace:
    """The shared flags; `extra(parser)` adds a script's own."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--target", type=Path, help="HF target dir (default: the test world's)")
    parser.add_argument("--prompts", type=Path, help="prompts JSON lines (default: the test world's)")
    parser.add_argument("--heldout-prompts", type=int, metavar="N",
                        help="instead of --prompts: N prompts cut from the world's held-out source files")
    parser.add_argument("--drafters", type=Path, nargs="+", help="checkpoints (default: two trained on the world)")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--out", type=Path, default=REPORT_DIR / default_out)
    # Tiny models are latency-bound; on a shared CPU extra threads spin-wait and only add noise.
    parser.add_argument("--threads", type=int, default=1)
    if extra:
        extra(parser)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    return args


def setup(args: argparse.Namespace, default_drafters=None):
    """(target_dir, target, prompts [(id, ids)], stop ids, {name: drafter}).

    `default_drafters(world)` gives the checkpoints used without `--drafters`
    (default: the two `BENCH_DRAFTERS`).
    """
    from dflash_audit.formats import load_any

    target_dir, prompts_path, drafter_paths = args.target, args.prompts, args.drafters
    if target_dir is None or prompts_path is None or not drafter_paths:
        from dflash_world import cached_test_world

        world = cached_test_world()
        target_dir = target_dir or world.target
        prompts_path = prompts_path or world.prompts
        drafter_paths = drafter_paths or (default_drafters(world) if default_drafters else
                                          [trained_drafter(world, name) for name in BENCH_DRAFTERS])
    target, tokenizer = load_target(target_dir)
    prompts = tokenize_prompts(tokenizer, heldout(args.heldout_prompts) if args.heldout_prompts
                               else load_prompts(prompts_path))
    drafters = {}
    for path in drafter_paths:
        loaded = load_any(path, target_dir)
        drafters[Path(path).stem] = build_drafter(loaded.spec, loaded.state_dict).float().eval()
    from foundation.target_vocab import stop_token_ids

    return Path(target_dir), target, prompts, stop_token_ids(target_dir, tokenizer).ids, drafters


def heldout(n: int) -> list[dict]:
    """`n` prompts drawn exactly as the worlds draw theirs (same seed, corpus and exclusions)."""
    from dflash_world import stdlib_corpus
    from dflash_world.world_cache import DEFAULT_MAX_BYTES
    from dflash_world.world_prompts import heldout_prompts

    train = stdlib_corpus("train", max_bytes=DEFAULT_MAX_BYTES)
    return heldout_prompts(stdlib_corpus("heldout", max_bytes=DEFAULT_MAX_BYTES), n, seed=0, avoid=train)


def timed(fn):
    started = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - started


def write_report(path: Path, payload: dict) -> None:
    payload = {**payload, "torch_threads": torch.get_num_threads()}
    text = json.dumps(payload, indent=2)
    atomic_write_bytes(Path(path), lambda tmp: Path(tmp).write_text(text))
    print(f"wrote {path}")

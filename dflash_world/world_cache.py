"""Build a world (tokenizer + trained target + prompts) once and reuse it."""

from __future__ import annotations

import hashlib
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from foundation.cache_dir import build_once, cache_root

from .corpus import DEFAULT_MAX_BYTES, stdlib_corpus
from .kernel_pins import run_pinned
from .world_prompts import heldout_prompts, write_prompts_jsonl
from .presets import DEFAULT_VOCAB_SIZE, TEST_TARGET

# Bump when the builders change what they produce, so stale caches are not reused.
WORLD_FORMAT = 2
# The kernels the world is trained under (kernel_pins.py: torch's, MKL's and oneDNN's AVX2 paths, one thread, in a
# process started with them), part of its identity so that a world trained with another CPU's own kernels is never
# reused.
WORLD_KERNELS = "avx2"
DEFAULT_HELDOUT_PROMPTS = 8


@dataclass(frozen=True)
class WorldPaths:
    root: Path
    target: Path  # HF model directory, tokenizer included
    prompts: Path  # held-out prompts, JSON lines

    @classmethod
    def under(cls, root: Path) -> WorldPaths:
        return cls(root=root, target=root / "target", prompts=root / "prompts.jsonl")

    def complete(self) -> bool:
        return (self.target / "config.json").is_file() and self.prompts.is_file()


def build_world(root: str | Path, preset: dict, *, vocab_size: int = DEFAULT_VOCAB_SIZE,
                max_bytes: int = DEFAULT_MAX_BYTES, n_prompts: int = DEFAULT_HELDOUT_PROMPTS,
                progress: bool = True) -> WorldPaths:
    """Write `root/target/` and `root/prompts.jsonl`, each only if missing.

    Both are written atomically, so a crash leaves each one whole or absent and a
    second call finishes the job.
    """
    paths = WorldPaths.under(Path(root))
    if paths.complete():
        return paths
    from .target_training import build_target  # torch and transformers: only when something is to be built
    from .tokenizer import train_tokenizer

    texts = stdlib_corpus("train", max_bytes=max_bytes)
    if not (paths.target / "config.json").is_file():
        tokenizer = train_tokenizer(texts, vocab_size=vocab_size)
        build_target(paths.target, tokenizer, texts, progress=progress, **preset)
    if not paths.prompts.is_file():
        heldout = stdlib_corpus("heldout", max_bytes=max_bytes)
        prompts = heldout_prompts(heldout, n_prompts, seed=preset["seed"], avoid=texts)
        write_prompts_jsonl(paths.prompts, prompts)
    return paths


def world_key(preset: dict, **builder_args) -> str:
    """Hash of everything the world depends on; the stdlib differs per Python build."""
    identity = {"format": WORLD_FORMAT, "kernels": WORLD_KERNELS, "python": sys.version, "preset": preset,
                **builder_args}
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]


def cached_test_world(root: str | Path | None = None) -> WorldPaths:
    """The test-suite's world (TEST_TARGET), built on first use under
    `root/<hash of builder params>/` (default root: `<cache root>/test-world`, see `foundation.cache_dir`)."""
    builder_args = {"vocab_size": DEFAULT_VOCAB_SIZE, "max_bytes": DEFAULT_MAX_BYTES,
                    "n_prompts": DEFAULT_HELDOUT_PROMPTS}
    root = Path(root) if root is not None else cache_root() / "test-world"
    paths = WorldPaths.under(root / world_key(TEST_TARGET, **builder_args))
    # Concurrent test processes wait for one builder instead of each training a target; it trains under the kernel
    # pins in a child process (kernel_pins.py), whatever this process's own kernels.
    def build() -> WorldPaths:
        run_pinned({"what": "world", "root": str(paths.root), "preset": TEST_TARGET, "builder_args": builder_args})
        return paths

    return build_once(root / f"{paths.root.name}.lock", lambda: paths if paths.complete() else None, build)

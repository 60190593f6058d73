"""The demo world: a tiny Qwen3 code model trained locally on the Python standard
library, its tokenizer (with the DFlash mask token), and prompts to draft on."""

from __future__ import annotations

import importlib

# Each name from its module, imported on first use: `python -m dflash_world.prebuild` on a world already built then
# imports neither torch nor transformers (several seconds of a `make test` otherwise).
_HOMES = {
    "WorldPaths": "world_cache", "build_world": "world_cache", "cached_test_world": "world_cache",
    "stdlib_corpus": "corpus",
    "BUILTIN_PROMPTS": "world_prompts", "heldout_prompts": "world_prompts", "write_prompts_jsonl": "world_prompts",
    "DEMO_TARGET": "presets", "TEST_TARGET": "presets", "build_target": "target_training",
    "EOS_TOKEN": "tokenizer", "MASK_TOKEN": "tokenizer", "mask_token_id": "tokenizer", "train_tokenizer": "tokenizer",
}

__all__ = sorted(_HOMES)


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_HOMES[name]}", __name__), name)

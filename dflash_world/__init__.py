"""The demo world: a tiny Qwen3 code model trained locally on the Python standard
library, its tokenizer (with the DFlash mask token), and prompts to draft on."""

from .world_cache import WorldPaths, build_world, cached_test_world
from .corpus import stdlib_corpus
from .world_prompts import BUILTIN_PROMPTS, heldout_prompts, write_prompts_jsonl
from .target_training import DEMO_TARGET, TEST_TARGET, build_target
from .tokenizer import EOS_TOKEN, MASK_TOKEN, mask_token_id, train_tokenizer

__all__ = [
    "BUILTIN_PROMPTS", "DEMO_TARGET", "EOS_TOKEN", "MASK_TOKEN", "TEST_TARGET", "WorldPaths",
    "build_target", "build_world", "cached_test_world", "heldout_prompts", "mask_token_id",
    "stdlib_corpus", "train_tokenizer", "write_prompts_jsonl",
]

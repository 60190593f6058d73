"""Offline τ: replay the DFlash and DDTree acceptance walks from cached target hidden states.

Greedy speculative decoding is lossless, so the live loop's output is the target's greedy
continuation, and the target's verdict at every position is already known: token t+1 of
that continuation. What a round accepts then depends only on the drafter's block at the
round's anchor, and that block depends only on the context features before the anchor.
So the target runs once per (target, prompts) — its greedy continuation, several prompts per
forward, with the states the drafters read captured on the way (`capture.py`), cached on disk
in the target's dtype (`cache.py`) — and each drafter only replays its own
rounds (`walks.py`): one batched pass per round for all prompts at once (`replay.py`), over
context K/V projected once per prompt, each block attending to just the keys it may see.
"""

from impl.offline.cache import (
                                CachedPrompt,
                                HiddenStateCache,
                                cache_bytes_estimate,
                                cache_key,
                                load_or_build_cache,
)
from impl.offline.replay import BlockReplay, block_key_mask
from impl.offline.walks import (
                                Mismatch,
                                find_mismatch,
                                offline_rounds,
                                offline_rounds_batch,
                                offline_rounds_each,
                                replay_walks,
)

__all__ = ["BlockReplay", "CachedPrompt", "HiddenStateCache", "Mismatch", "block_key_mask", "cache_bytes_estimate",
           "cache_key", "find_mismatch", "load_or_build_cache", "offline_rounds", "offline_rounds_batch",
           "offline_rounds_each", "replay_walks"]

"""Offline τ, the one runner `eval --mode offline` and `compare`'s dynamic audit share: the target's greedy
continuation of each prompt cached once (the layers every drafter reads captured on the way), then each
drafter's rounds replayed from that cache per method (impl.offline does the work).

Under torchrun (`ranks`) rank 0 builds the cache (the others then read it), each rank replays its share of
the prompts, and every rank gets all replays back.
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from dflash_audit.progress import NoProgress
from dflash_audit.ranks import Ranks
from impl import offline


# The engine that makes the cache when not the transformers pass (`--hidden-states vllm`: dflash_audit/vllm_states.py),
# set for one command's run by `hidden_states_from`: every offline replay of that run reads its cache from it.
CACHE_BUILDER: ContextVar[Any] = ContextVar("cache_builder", default=None)


@contextmanager
def hidden_states_from(builder):
    """Offline caches made by `builder` (None: the transformers pass) for the runs inside."""
    token = CACHE_BUILDER.set(builder)
    try:
        yield builder
    finally:
        CACHE_BUILDER.reset(token)


@dataclass
class OfflineRun:
    cache: offline.HiddenStateCache
    rounds: dict[tuple[str, str, int], list[int]]  # (method, drafter name, prompt index) -> acceptance lengths
    gathered: list[dict]  # every rank's `also_gather` records
    engine: dict | None = None  # what made the cache when not the transformers pass (its facts)


def replay_offline(drafters: dict[str, torch.nn.Module], target, target_dir: str | Path,
                   prompts: list[tuple[str, torch.Tensor]], max_new_tokens: int, stop_ids: list[int],
                   plan: list[tuple[str, int | None]], cache_dir: str | Path, ranks: Ranks | None = None,
                   progress=None, on_prompt: Callable[[int], None] | None = None,
                   on_cache: Callable[[offline.HiddenStateCache], None] | None = None,
                   also_gather: Callable[[], list[dict]] = list) -> OfflineRun:
    """Every drafter of `drafters` (name -> drafter) replayed per (method, budget) of `plan` on the cache of
    `prompts` ([(id, input_ids [1, T])]) under `cache_dir`. `on_prompt(tokens)` is told of each prompt the target
    generates (none when the cache is found) and `on_cache(cache)` once it is ready; `progress.advance` of each replayed prompt's tokens;
    `also_gather()`, called after this rank's replays, adds records to the one gather of them."""
    ranks = ranks or Ranks.single()
    progress = progress or NoProgress()
    layer_ids = sorted({i for drafter in drafters.values() for i in drafter.target_layer_ids})
    builder = CACHE_BUILDER.get()
    cache = ranks.rank_zero_first(lambda: offline.load_or_build_cache(
        cache_dir, target_dir, target, prompts, max_new_tokens, stop_ids, layer_ids=layer_ids, on_prompt=on_prompt,
        builder=builder))
    if on_cache is not None:
        on_cache(cache)
    mine = ranks.shard(list(range(len(cache.prompts))))
    entries = [cache.prompts[i] for i in mine]
    local = []
    for method, budget in plan:
        for name, drafter in drafters.items():  # batched over prompts: one drafter pass per round of all
            for i, (_, rounds) in zip(mine, offline.offline_rounds_each(drafter, target, cache, entries, method,
                                                                         budget)):
                local.append({"method": method, "side": name, "index": i, "rounds": rounds})
                progress.advance(len(cache.prompts[i].token_ids) - cache.prompts[i].prompt_len)
    gathered = ranks.gather(local + also_gather())
    rounds = {(r["method"], r["side"], r["index"]): r["rounds"] for r in gathered if "rounds" in r}
    engine = {"engine": builder.name, **builder.facts} if builder is not None else None
    return OfflineRun(cache, rounds, [r for r in gathered if "rounds" not in r], engine)

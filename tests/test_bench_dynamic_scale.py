"""bench/bench_dynamic_scale.py's τ row counts the partings of the live loop from the offline replay as the tests
count them: each set against the features the live drafter read (`explain_parting`, in the bench's `live_partings`)
and judged by the one near-tie rule (`impl.offline.walks.unexplained_partings`, `impl/near_tie.py`). In bfloat16 a
parting the rounding of the target's states decides is not counted; one the states do not explain is.

The test world's target and trained drafter in bfloat16, the world's prompts, 32 new tokens; the cache's states after
each prompt moved by seeded noise: within bfloat16's rounding (4 ulps at each layer's scale) a drafter decision
parts as a near-tie, which the bench leaves out; far past it (64 ulps) every parting counts.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from impl.near_tie import ROUNDING_ULPS
from impl.offline import load_or_build_cache, offline_rounds
from impl.offline.walks import unexplained_partings

NEW_TOKENS = 32
BF16 = torch.bfloat16


@pytest.fixture(scope="module")
def bf16_world(trained_pair, test_world, tmp_path_factory):
    """(drafter, target, prompts, stop ids, the offline cache), the target and the drafter in bfloat16 as `compare
    --dtype bfloat16` builds them."""
    from foundation.placement import Placement, built_in
    from foundation.target import load_target_model
    from impl.body_shapes import build_drafter

    trained, _, prompts, stop_ids = trained_pair
    target = load_target_model(test_world.target, Placement(torch.device("cpu"), BF16, "test"))
    drafter = built_in(torch.device("cpu"), BF16, lambda: build_drafter(trained.spec, trained.state_dict())).eval()
    cache = load_or_build_cache(tmp_path_factory.mktemp("bench-cache"), test_world.target, target, prompts,
                                NEW_TOKENS, stop_ids)
    return drafter, target, prompts, stop_ids, cache


def nudged(cache, ulps: float, seed: int = 0):
    """The cache with every state after each prompt moved by seeded uniform noise of up to `ulps` ulps of bfloat16 at
    its layer's scale (the prompt's own states kept)."""
    generator = torch.Generator().manual_seed(seed)
    prompts = []
    for entry in cache.prompts:
        layers = {}
        for layer_id, states in entry.layers.items():
            scale = torch.finfo(BF16).eps * states.float().abs().max()
            noise = (torch.rand(states.shape, generator=generator) * 2 - 1) * ulps * scale
            noise[:entry.prompt_len] = 0
            layers[layer_id] = (states.float() + noise).to(states.dtype)
        prompts.append(replace(entry, layers=layers))
    return replace(cache, prompts=prompts)


def bench_partings(bf16_world, ulps: float):
    """The bench's own judging (`live_partings`) of the live loop against the replay of the nudged cache."""
    from bench.bench_dynamic_scale import live_partings

    drafter, target, prompts, stop_ids, cache = bf16_world
    moved = nudged(cache, ulps)
    offline = [offline_rounds(drafter, target, moved, entry, "dflash") for entry in moved.prompts]
    with torch.inference_mode():
        _, partings, _ = live_partings(drafter, target, moved, [ids for _, ids in prompts], offline, NEW_TOKENS,
                                       stop_ids, "cpu")
    return partings


def test_a_bfloat16_near_tie_is_not_counted_and_a_parting_past_the_rounding_is(bf16_world):
    within = bench_partings(bf16_world, 4)
    assert within, "no parting: the 4-ulp nudge decided no drafter choice"
    for parting in within:  # each a drafter near-tie by the rule: walks as live from the live features, gap moved
        assert parting.replayed and parting.feature_ulps <= ROUNDING_ULPS and parting.margin <= parting.moved
    assert unexplained_partings(within, BF16) == []  # the bench's τ row counts none of them
    assert len(unexplained_partings(within, torch.float32)) == len(within)  # float32: no tie between one kernel

    past = bench_partings(bf16_world, 64)
    assert past and unexplained_partings(past, BF16) == [p.describe() for p in past]
    assert all(p.feature_ulps > ROUNDING_ULPS for p in past)

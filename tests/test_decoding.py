"""Live DFlash (`impl.decoding`) on its own: lossless, reproducible, bounded, counted.

Its parity with z-lab's `dflash_generate` (greedy and sampled, trained and random pairs)
lives in `conformance/test_live_decoding.py`.
"""

from __future__ import annotations

import pytest
import torch

from dflash_world.suite_placement import placed_drafter, placed_target
from impl.decoding import acceptance_histogram, dflash_decode
from tests.helpers import greedy_decode
from impl.model import DFlashDrafter
from tests.helpers import tiny_spec, tiny_target


@pytest.mark.dynamic
def test_live_dflash_is_lossless(trained_pair):
    drafter, target, prompts, stop_ids = trained_pair
    for prompt_id, ids in prompts[:4]:
        ours = dflash_decode(drafter, target, ids, 96, stop_ids)
        assert torch.equal(ours.output_ids, greedy_decode(target, ids, 96, stop_ids)), prompt_id
        assert sum(ours.acceptance_lengths) + 1 == len(ours.new_tokens)


@pytest.mark.dynamic
def test_sampling_is_reproducible_under_a_seed(trained_pair):
    drafter, target, prompts, stop_ids = trained_pair
    _, ids = prompts[0]
    runs = [dflash_decode(drafter, target, ids, 48, stop_ids, temperature=0.8, seed=7) for _ in range(2)]
    assert torch.equal(runs[0].output_ids, runs[1].output_ids)
    assert runs[0].acceptance_lengths == runs[1].acceptance_lengths


@pytest.mark.dynamic
def test_stop_token_and_max_new_tokens_bound_the_output():
    torch.manual_seed(0)
    drafter, target = placed_drafter(DFlashDrafter(tiny_spec())), placed_target(tiny_target())
    ids = torch.randint(0, 120, (1, 10), generator=torch.Generator().manual_seed(0))
    free = greedy_decode(target, ids, 30)
    stop = free[0, 10 + 7].item()  # the 8th generated token becomes a stop token
    run = dflash_decode(drafter, target, ids, 30, [stop])
    assert run.new_tokens[-1] == stop and stop not in run.new_tokens[:-1]
    assert len(dflash_decode(drafter, target, ids, 5).new_tokens) == 5


def test_acceptance_histogram_counts_lengths():
    assert acceptance_histogram([1, 3, 3, 8], 8) == [0, 1, 0, 2, 0, 0, 0, 0, 1]

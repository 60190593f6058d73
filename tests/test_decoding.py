"""Live DFlash (`impl.decoding`) against z-lab's `dflash_generate`, round by round.

The pair that makes acceptances non-trivial: the `test_world` target (a small Qwen3
trained on the standard library) and a drafter trained briefly on the same corpus by our
own trainer (`impl.train.train_drafter`), cached on disk next to the world. A random
drafter (which accepts ~nothing) covers the sliding-window cache paths on tiny models.
"""

from __future__ import annotations

import torch

from impl.decoding import acceptance_histogram, dflash_decode, greedy_decode
from impl.model import DFlashDrafter
from reference_adapters.zlab_adapter import zlab_generate, zlab_twin
from tests.helpers import tiny_spec, tiny_target


def test_live_dflash_equals_zlab_per_round_on_a_trained_pair(trained_pair):
    drafter, target, prompts, stop_ids = trained_pair
    twin = zlab_twin(drafter)
    taus = []
    for prompt_id, ids in prompts:
        ours = dflash_decode(drafter, target, ids, 96, stop_ids)
        ref = zlab_generate(twin, target, ids, 96, stop_ids)
        assert ours.acceptance_lengths == ref.acceptance_lengths, prompt_id
        assert torch.equal(ours.output_ids, ref.output_ids), prompt_id
        taus.append(ours.tau)
    # The pair must really speculate, or equality above would be trivial.
    assert sum(taus) / len(taus) > 1.5, taus


def test_live_dflash_is_lossless(trained_pair):
    drafter, target, prompts, stop_ids = trained_pair
    for prompt_id, ids in prompts[:4]:
        ours = dflash_decode(drafter, target, ids, 96, stop_ids)
        assert torch.equal(ours.output_ids, greedy_decode(target, ids, 96, stop_ids)), prompt_id
        assert sum(ours.acceptance_lengths) + 1 == len(ours.new_tokens)


def test_sampling_equals_zlab_under_the_same_seed(trained_pair):
    """Rejection sampling draws in z-lab's order, so equal seeds give equal tokens and rounds."""
    drafter, target, prompts, stop_ids = trained_pair
    twin = zlab_twin(drafter)
    for seed, (prompt_id, ids) in enumerate(prompts[:3]):
        ours = dflash_decode(drafter, target, ids, 64, stop_ids, temperature=0.8, seed=seed)
        torch.manual_seed(seed)
        ref = zlab_generate(twin, target, ids, 64, stop_ids, temperature=0.8)
        assert ours.acceptance_lengths == ref.acceptance_lengths, prompt_id
        assert torch.equal(ours.output_ids, ref.output_ids), prompt_id
        again = dflash_decode(drafter, target, ids, 64, stop_ids, temperature=0.8, seed=seed)
        assert torch.equal(again.output_ids, ours.output_ids)


def test_random_drafter_with_sliding_layers_equals_zlab():
    spec = tiny_spec()  # sliding window 6 < block 8 < sequence: both caches roll over the window
    torch.manual_seed(3)
    drafter = DFlashDrafter(spec).eval()
    target = tiny_target()
    for seed in range(3):
        ids = torch.randint(0, 120, (1, 12), generator=torch.Generator().manual_seed(seed))
        ours = dflash_decode(drafter, target, ids, 40, [5])
        ref = zlab_generate(zlab_twin(drafter), target, ids, 40, [5])
        assert ours.acceptance_lengths == ref.acceptance_lengths
        assert torch.equal(ours.output_ids, ref.output_ids)


def test_sampling_on_random_models_equals_zlab_under_the_same_seed():
    torch.manual_seed(1)
    drafter, target = DFlashDrafter(tiny_spec()).eval(), tiny_target()
    twin = zlab_twin(drafter)  # built before seeding: model init draws from the global generator
    ids = torch.randint(0, 120, (1, 16), generator=torch.Generator().manual_seed(0))
    for seed in range(3):
        torch.manual_seed(seed)
        ref = zlab_generate(twin, target, ids, 40, [5], temperature=1.5)  # near-uniform: long acceptances
        ours = dflash_decode(drafter, target, ids, 40, [5], temperature=1.5, seed=seed)
        assert ours.acceptance_lengths == ref.acceptance_lengths
        assert torch.equal(ours.output_ids, ref.output_ids)
    assert max(ours.acceptance_lengths) > 2


def test_stop_token_and_max_new_tokens_bound_the_output():
    torch.manual_seed(0)
    drafter, target = DFlashDrafter(tiny_spec()).eval(), tiny_target()
    ids = torch.randint(0, 120, (1, 10), generator=torch.Generator().manual_seed(0))
    free = greedy_decode(target, ids, 30)
    stop = free[0, 10 + 7].item()  # the 8th generated token becomes a stop token
    run = dflash_decode(drafter, target, ids, 30, [stop])
    assert run.new_tokens[-1] == stop and stop not in run.new_tokens[:-1]
    assert len(dflash_decode(drafter, target, ids, 5).new_tokens) == 5


def test_acceptance_histogram_counts_lengths():
    assert acceptance_histogram([1, 3, 3, 8], 8) == [0, 1, 0, 2, 0, 0, 0, 0, 1]

"""#17 τ and #16 block size: live decoding vs z-lab's `dflash_generate`, round by round, on a DFlash
and a DFlash2 drafter (whose proposals come from its candidate selector).

Random weights accept nothing greedily (τ = 1 everywhere) and would prove little, so the
world's trained target gets the shared drafter trained by our trainer on its corpus; both
loops then decode the same prompts with the same weights, greedily and by rejection
sampling under the same seed. Random tiny models cover what a trained pair does not reach:
sliding windows shorter than the block (both caches roll over the window) and near-uniform
sampling (long acceptances).
"""

import contextlib
import json
from unittest import mock

import pytest
import torch

from conformance.tolerances import EXACT
from conformance.world import target_for
from dflash_world.suite_placement import placed_target
from foundation.jsonl import split_json_lines
from foundation.placement import target_device
from impl.model import DFlashDrafter
from impl.spec import DraftSpec

pytestmark = [pytest.mark.slow, pytest.mark.dynamic, pytest.mark.pitfall(17)]
MAX_NEW_TOKENS = 96
PROMPTS = 8
SAMPLED_PROMPTS, SAMPLED_TOKENS, TEMPERATURE = 3, 64, 0.8


def live_decode(conform, names, impl, spec, weights, target, input_ids, *args):
    """`(ok, GenerationResult)` of building a drafter and one decode, through the comparator: a case the
    implementation cannot run (e.g. a family it does not have) is recorded n/a, any other error as the
    divergence it is. The prompt goes where the target is (z-lab's prefill reads it there)."""
    input_ids = input_ids.to(target_device(target))
    with torch.no_grad(), zlab_attention_accumulated_in_float32():
        return conform.run(names, lambda: impl.generate(impl.build_drafter(spec, weights, target), target, input_ids,
                                                        *args), what=f"{impl.name} generate")


@contextlib.contextmanager
def zlab_attention_accumulated_in_float32():
    """z-lab's drafter attention (its `ALL_ATTENTION_FUNCTIONS["sdpa"]` call) fed float32 queries, keys and
    values and its output rounded back, as ours computes it (`DraftAttention.attend`, on purpose: the
    offline replay and the live loop then agree exactly in bfloat16). Below float32 the two orders of
    rounding otherwise differ by an ulp, enough to flip a near-tie; everything else (z-lab's loop, its
    drafting, verification, sampling, convolutions, selector) stays its own. In float32 the cast is
    the identity: the very same call."""
    import dflash.model as zlab_model

    registry = zlab_model.ALL_ATTENTION_FUNCTIONS
    sdpa = registry["sdpa"]

    def float32_sdpa(module, query, key, value, attention_mask, **kwargs):
        out, weights = sdpa(module, query.float(), key.float(), value.float(), attention_mask, **kwargs)
        return out.to(query.dtype), weights

    with mock.patch.object(zlab_model, "ALL_ATTENTION_FUNCTIONS", {**{k: registry[k] for k in registry},
                                                                   "sdpa": float32_sdpa}):
        yield


@pytest.fixture(scope="module", params=["dflash", "dflash2"])
def trained_pair(request):
    """The world's trained DFlash drafter, then its DFlash2 twin (proposals through the selector)."""
    from dflash_world import cached_test_world
    from dflash_world.drafter import cached_dflash2_drafter, cached_test_drafter
    from dflash_world.suite_placement import audit_placement, world_in_suite_dtype
    from drafter_files.checkpoint import load_checkpoint
    from foundation.target import load_target_model

    world = world_in_suite_dtype(cached_test_world())
    out = cached_dflash2_drafter(world) if request.param == "dflash2" else cached_test_drafter(world)
    ckpt = load_checkpoint(out)
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(str(world.target))
    prompts = [json.loads(line)["prompt"] for line in split_json_lines(world.prompts.read_text())[:PROMPTS]]
    # On the suite's device and in its dtype (`make gpu-check`, `make test`'s bfloat16 pass); each
    # implementation builds its drafter where and in what dtype the target runs.
    target = load_target_model(world.target, audit_placement())
    from foundation.target_vocab import stop_token_ids

    stops = stop_token_ids(world.target, tokenizer).ids  # z-lab's rule, as eval and compare stop
    return ckpt, target, [tokenizer(p, return_tensors="pt").input_ids for p in prompts], stops


@pytest.mark.compare("generate", references=("zlab",))
def test_per_round_acceptance_and_tau_p17(conform, pair, trained_pair):
    ckpt, target, prompts, stop = trained_pair
    a, b = pair
    taus = {}
    for index, input_ids in enumerate(prompts):
        conform.describe({"prompt": index, "max_new_tokens": MAX_NEW_TOKENS, "block_size": ckpt.spec.block_size})
        runs = {}
        for impl in (a, b):
            ok, runs[impl.name] = live_decode(conform, (a.name, b.name), impl, ckpt.spec, ckpt.state_dict, target,
                                              input_ids, MAX_NEW_TOKENS, stop)
            if not ok:  # a case this implementation cannot run: recorded n/a
                return
        rounds_a, rounds_b = runs[a.name].acceptance_lengths, runs[b.name].acceptance_lengths
        conform.compare((a.name, b.name), rounds_a, rounds_b, EXACT,
                        what=f"prompt {index}: per-round acceptance lengths")
        conform.compare((a.name, b.name), runs[a.name].output_ids, runs[b.name].output_ids, EXACT,
                        what=f"prompt {index}: generated ids")
        longest = max(rounds_a + rounds_b)
        conform.compare((a.name, "rule"), longest <= ckpt.spec.block_size, True,
                        what=f"a round accepts at most B-1 drafted tokens + 1 bonus (longest {longest})", pitfall=16)
        taus[index] = sum(rounds_a) / len(rounds_a)
        conform.compare((a.name, b.name), taus[index], sum(rounds_b) / len(rounds_b), EXACT,
                        what=f"prompt {index}: tau = mean acceptance length")
    # The pair must be trained enough for the comparison to mean something.
    assert sum(taus.values()) / len(taus) > 1.2, f"drafter accepts too little to test decoding: {taus}"


def rounds_and_ids(conform, a, b, runs, what: str) -> None:
    conform.compare((a.name, b.name), runs[a.name].acceptance_lengths, runs[b.name].acceptance_lengths,
                    EXACT, what=f"{what}: per-round acceptance lengths")
    conform.compare((a.name, b.name), runs[a.name].output_ids, runs[b.name].output_ids, EXACT,
                    what=f"{what}: generated ids")


@pytest.mark.compare("generate", references=("zlab",))
def test_sampled_rounds_under_the_same_seed_p17(conform, pair, trained_pair):
    """Rejection sampling draws in z-lab's order: equal seeds give equal tokens and rounds."""
    ckpt, target, prompts, stop = trained_pair
    a, b = pair
    for seed, input_ids in enumerate(prompts[:SAMPLED_PROMPTS]):
        conform.describe({"prompt": seed, "temperature": TEMPERATURE, "seed": seed})
        runs = {}
        for impl in (a, b):
            ok, runs[impl.name] = live_decode(conform, (a.name, b.name), impl, ckpt.spec, ckpt.state_dict, target,
                                              input_ids, SAMPLED_TOKENS, stop, TEMPERATURE, seed)
            if not ok:  # a case this implementation cannot run: recorded n/a
                return
        rounds_and_ids(conform, a, b, runs, f"prompt {seed}, T={TEMPERATURE}, seed {seed}")


def random_pair():
    """A random drafter with sliding window 6 < block 8 < sequence, and a random tiny target."""
    spec = DraftSpec(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                     num_hidden_layers=3, target_vocab_size=96, target_layer_ids=(1, 3, 4), num_target_layers=6,
                     mask_token_id=95, block_size=8,
                     layer_types=("sliding_attention", "full_attention", "sliding_attention"), sliding_window=6)
    torch.manual_seed(3)
    return spec, DFlashDrafter(spec).state_dict(), placed_target(target_for(spec))


@pytest.mark.compare("generate", references=("zlab",))
@pytest.mark.parametrize("temperature", [0.0, 1.5])
def test_random_models_with_rolling_sliding_windows_p17(conform, pair, temperature):
    spec, weights, target = random_pair()
    a, b = pair
    longest = 0
    for seed in range(3):
        ids = torch.randint(0, spec.target_vocab_size - 1, (1, 12 + 4 * seed), generator=torch.Generator().manual_seed(seed))
        conform.describe({"seed": seed, "temperature": temperature, "prompt_len": ids.shape[1]})
        runs = {}
        for impl in (a, b):
            ok, runs[impl.name] = live_decode(conform, (a.name, b.name), impl, spec, weights, target, ids, 40, [5],
                                                  temperature, seed)
            if not ok:  # a case this implementation cannot run: recorded n/a
                return
        rounds_and_ids(conform, a, b, runs, f"random pair, seed {seed}, T={temperature}")
        longest = max([longest, *runs[a.name].acceptance_lengths])
    if temperature > 1:  # near-uniform sampling must reach past the first slot, or the blocks were not tested
        conform.compare((a.name, "rule"), longest > 2, True,
                        what=f"near-uniform sampling accepts long runs (longest {longest})")

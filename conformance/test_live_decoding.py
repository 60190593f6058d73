"""#17 τ and #16 block size: live greedy decoding vs z-lab's `dflash_generate` on a TRAINED target/drafter pair.

Random weights accept nothing (τ = 1 everywhere) and would prove nothing, so the world's
trained target gets the shared drafter trained by our trainer on its corpus; both
loops then decode the same prompts with the same weights, round by round.
"""

import json

import pytest
import torch

from conformance.tolerances import EXACT

pytestmark = [pytest.mark.slow, pytest.mark.pitfall(17)]
MAX_NEW_TOKENS = 48
PROMPTS = 4


@pytest.fixture(scope="module")
def trained_pair():
    from impl.checkpoint import load_checkpoint
    from impl.target import load_target_model
    from world import cached_test_world
    from world.drafter import cached_test_drafter

    world = cached_test_world()
    out = cached_test_drafter(world)
    ckpt = load_checkpoint(out)
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(str(world.target))
    prompts = [json.loads(line)["prompt"] for line in world.prompts.read_text().splitlines()[:PROMPTS]]
    target = load_target_model(world.target)
    if isinstance(target, tuple):
        target = target[0]
    return ckpt, target.float().eval(), [tokenizer(p, return_tensors="pt").input_ids for p in prompts], tokenizer


@pytest.mark.compare("generate", component="tau", references=("zlab",))
def test_per_round_acceptance_and_tau_p17(conform, pair, trained_pair):
    ckpt, target, prompts, tokenizer = trained_pair
    a, b = pair
    stop = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else None
    taus = {}
    for index, input_ids in enumerate(prompts):
        conform.describe({"prompt": index, "max_new_tokens": MAX_NEW_TOKENS, "block_size": ckpt.spec.block_size})
        runs = {}
        for impl in (a, b):
            drafter = impl.build_drafter(ckpt.spec, ckpt.state_dict, target)
            with torch.no_grad():
                runs[impl.name] = impl.generate(drafter, target, input_ids, MAX_NEW_TOKENS, stop)
        rounds_a, rounds_b = runs[a.name].acceptance_lengths, runs[b.name].acceptance_lengths
        conform.compare("tau", 17, (a.name, b.name), rounds_a, rounds_b, EXACT,
                        what=f"prompt {index}: per-round acceptance lengths")
        conform.compare("tau", 17, (a.name, b.name), runs[a.name].output_ids, runs[b.name].output_ids, EXACT,
                        what=f"prompt {index}: generated ids")
        longest = max(rounds_a + rounds_b)
        conform.compare("block_size", 16, (a.name, "rule"), longest <= ckpt.spec.block_size, True,
                        what=f"a round accepts at most B-1 drafted tokens + 1 bonus (longest {longest})")
        taus[index] = sum(rounds_a) / len(rounds_a)
        conform.compare("tau", 17, (a.name, b.name), taus[index], sum(rounds_b) / len(rounds_b), EXACT,
                        what=f"prompt {index}: tau = mean acceptance length")
    # The pair must be trained enough for the comparison to mean something.
    assert sum(taus.values()) / len(taus) > 1.2, f"drafter accepts too little to test decoding: {taus}"

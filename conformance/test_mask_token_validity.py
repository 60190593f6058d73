"""#34 mask-token validity: a target that itself generates the mask id. Every decoding loop must keep that
token: greedy speculative decoding reproduces the target's own greedy output (`transformers`' generate). A
reference loop that drops it is a reference divergence listed with its file:line in
`checks.vocab.KNOWN_MASK_DROPS`; none of the installed ones does (z-lab's `dflash_generate` keeps it; speculators
has no decoding loop: n/a). The static side (the id inside the target's vocabulary and embedding, none of its
eos/pad/bos; its row's norm) is the audit's `mask_token_validity` finding (tests/test_mask_vocab_audit.py).

Two cases: a tiny random pair, where the token comes as each round's bonus, and the world's trained pair, where
the drafter also proposes it and the target accepts it."""

import json

import pytest

from conformance.checks import vocab


@pytest.mark.quick
def test_the_tiny_target_generates_the_mask_id():
    case = vocab.mask_kept_case()
    assert case.occurrences >= 2


@pytest.mark.quick
@pytest.mark.pitfall(34)
@pytest.mark.compare("generate", references=("zlab", "speculators"))
def test_generated_mask_id_is_kept_p34(conform, pair):
    vocab.mask_token_kept(conform, *pair, vocab.mask_kept_case())


@pytest.fixture(scope="module")
def trained_case():
    """The world's trained target and drafter on 4 held-out prompts, the mask id = the target's most frequent
    token (a newline)."""
    from dflash_world import cached_test_world
    from dflash_world.drafter import cached_test_drafter
    from dflash_world.suite_placement import audit_placement, world_in_suite_dtype
    from drafter_files.checkpoint import load_checkpoint
    from foundation.jsonl import split_json_lines
    from foundation.placement import target_device
    from foundation.target import load_target

    world = world_in_suite_dtype(cached_test_world())  # the suite's device and dtype (make test's bf16 pass)
    ckpt = load_checkpoint(cached_test_drafter(world))
    target, tokenizer = load_target(world.target, audit_placement())
    prompts = [tokenizer(json.loads(line)["prompt"], return_tensors="pt").input_ids.to(target_device(target))
               for line in split_json_lines(world.prompts.read_text())[:4]]
    return vocab.with_generated_mask(ckpt.spec, ckpt.state_dict, target, prompts, 48)


@pytest.mark.slow
@pytest.mark.dynamic
@pytest.mark.pitfall(34)
@pytest.mark.compare("generate", references=("zlab", "speculators"))
def test_drafted_and_accepted_mask_id_is_kept_p34(conform, pair, trained_case):
    drafted = vocab.mask_token_kept(conform, *pair, trained_case)
    for name, count in drafted.items():  # the case reaches the path where a proposal equal to the mask id is accepted
        conform.compare((name, "rule"), count > 0, True,
                        what=f"{name} accepted proposals equal to mask id {trained_case.spec.mask_token_id} "
                             f"({count} of the {trained_case.occurrences} the target emits)")

"""#34 mask-token validity and #36 vocabulary sizes, on tiny real models.

- `mask_token_kept`: a target whose own greedy continuation contains the mask id (the id is chosen as a token it
  emits). Speculative decoding with greedy verification must reproduce the target's plain greedy output exactly,
  that token included, in every decoding loop: ours and each reference's own (z-lab's `dflash_generate`).
  `transformers`' own `generate` is the ground truth. A reference that drops the token is a reference divergence,
  and must be listed in `KNOWN_MASK_DROPS` with its file:line, so a change either way fails the test.
- `padded_vocabulary`: a target whose embedding has rows the tokenizer never produces (a padded vocabulary): the
  draft logits must span every row of the target's vocabulary, in training (against speculators' own forward).
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch

from conformance.checks.training import on_reference_anchors
from conformance.comparator import Comparator
from conformance.strategies import TrainingCase
from conformance.tolerances import EXACT, for_dtype
from conformance.world import VOCAB, reference_state_dict, target_for
from impl.spec import DraftSpec

# Reference decoding loops known to drop a generated token equal to the mask id: {reference: "file:line"}.
# z-lab dflash 0.1.0's `dflash_generate` (dflash/model.py:197-314) fills its output buffer with the mask id and
# writes every accepted and bonus token over it, with no filter: it keeps the token. speculators 0.9.0 has no
# decoding loop (it trains; vLLM serves), so it is n/a.
KNOWN_MASK_DROPS: dict[str, str] = {}
MASK_SPEC = DraftSpec(hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1,
                      head_dim=16, num_hidden_layers=2, target_vocab_size=VOCAB, target_layer_ids=(0, 2),
                      num_target_layers=4, mask_token_id=VOCAB - 1, block_size=4,
                      layer_types=("full_attention", "full_attention"))


@dataclass(frozen=True, eq=False)
class MaskKeptCase:
    spec: DraftSpec  # its mask id is a token the target emits
    weights: dict[str, torch.Tensor]  # the drafter's
    target: Any
    prompts: tuple[torch.Tensor, ...]
    expected: tuple[tuple[int, ...], ...]  # per prompt, the target's own greedy continuation (transformers' generate)

    @property
    def occurrences(self) -> int:
        """How often the target emits the mask id after each prompt's first new token (the prefill's)."""
        return sum(cont[1:].count(self.spec.mask_token_id) for cont in self.expected)


def with_generated_mask(spec: DraftSpec, weights, target, prompts, max_new_tokens: int) -> MaskKeptCase:
    """The case for `spec`'s drafter on `target`, its mask id replaced by the token the target emits most often
    after the first new token (ties: the smallest id), so the verify rounds themselves must produce it."""
    expected = tuple(tuple(target_greedy(target, ids, max_new_tokens)) for ids in prompts)
    counts = Counter(token for cont in expected for token in cont[1:])
    mask = min(counts, key=lambda token: (-counts[token], token))
    return MaskKeptCase(dataclasses.replace(spec, mask_token_id=mask), weights, target, tuple(prompts), expected)


@lru_cache(maxsize=1)
def mask_kept_case() -> MaskKeptCase:
    """A tiny random target and drafter: the mask-id tokens come as the rounds' bonus tokens."""
    prompt = torch.randint(0, VOCAB, (1, 10), generator=torch.Generator().manual_seed(7))
    return with_generated_mask(MASK_SPEC, reference_state_dict(MASK_SPEC), target_for(MASK_SPEC), [prompt], 24)


@torch.no_grad()
def target_greedy(target, input_ids: torch.Tensor, max_new_tokens: int) -> list[int]:
    """transformers' own greedy `generate`, with no stop token: the new tokens."""
    out = target.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=max_new_tokens,
                          min_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, input_ids.shape[1]:].tolist()


def drafted_and_accepted(new_tokens: list[int], rounds: list[int], token: int) -> int:
    """How many of `token` a loop produced as accepted proposals (each round's tokens but its last, the bonus;
    the first new token is the prefill's)."""
    found, position = 0, 1
    for length in rounds:
        found += new_tokens[position:position + length - 1].count(token)
        position += length
    return found


def mask_token_kept(cmp: Comparator, a, b, case: MaskKeptCase) -> dict[str, int]:
    """Each loop's new tokens equal the target's greedy continuation, including the tokens equal to the mask id.
    Returns, per implementation, how many mask-id tokens it produced as accepted proposals."""
    mask, drafted = case.spec.mask_token_id, {}
    for impl in (a, b):
        names = (impl.name, "transformers")
        ok, drafter = cmp.run(names, lambda impl=impl: impl.build_drafter(case.spec, case.weights, case.target),
                              what=f"{impl.name} build_drafter")
        if not ok:
            return drafted
        where = KNOWN_MASK_DROPS.get(impl.name, "")
        drafted[impl.name] = 0
        for index, (input_ids, expected) in enumerate(zip(case.prompts, case.expected)):
            ok, result = cmp.run(names, lambda impl=impl, ids=input_ids: impl.generate(
                drafter, case.target, ids, len(expected), None), what=f"{impl.name} generate")
            if not ok:
                return drafted
            new = result.output_ids[0, input_ids.shape[1]:].tolist()
            entry = cmp.compare(names, new, list(expected), EXACT,
                                what=f"prompt {index}: generated tokens keep the {expected[1:].count(mask)} the "
                                     f"target emits equal to mask id {mask} ({new[1:].count(mask)} kept)"
                                     f"{'; drops them at ' + where if where else ''}")
            # A reference's drop is recorded, not raised; it must be the known one (and a known one must drop).
            assert (entry is not None) == bool(where and mask in expected), (
                f"{impl.name}: {'drops' if entry is not None else 'keeps'} generated tokens equal to the mask id, "
                f"but KNOWN_MASK_DROPS says it {'drops them at ' + where if where else 'keeps them'}")
            drafted[impl.name] += drafted_and_accepted(new, result.acceptance_lengths, mask)
    return drafted


# The padded case: rows from TOKENIZER_LENGTH on stand for a padded vocabulary's rows (ids a tokenizer of that
# length never produces); the target's embedding has VOCAB rows.
TOKENIZER_LENGTH = VOCAB - 16
# One document: packing across documents is #9's rule, not this one (SpecForge attends across them).
PADDED_TRAINING = TrainingCase(spec=MASK_SPEC, lengths=(21,), padding=2, max_anchors=6, seed=3)


def padded_vocabulary(cmp: Comparator, a, b, case: TrainingCase = PADDED_TRAINING) -> None:
    """Training-layout draft logits span the target's padded vocabulary (its embedding rows), padding rows included,
    and agree with the reference's there."""
    outs = on_reference_anchors(cmp, a, b, case)
    if outs is None:
        return
    out_a, out_b = outs
    rows = target_for(case.spec).get_input_embeddings().weight.shape[0]
    for name, out in ((a.name, out_a), (b.name, out_b)):
        cmp.compare((name, "transformers"), out.logits.shape[-1], rows,
                    what=f"{name}'s draft logits span the target's {rows} embedding rows (the padded vocabulary, "
                         f"not the tokenizer's {TOKENIZER_LENGTH})")
    valid = out_b.anchor_valid.reshape(-1).repeat_interleave(case.spec.block_size)
    cmp.compare((a.name, b.name), out_a.logits[:, valid, TOKENIZER_LENGTH:], out_b.logits[:, valid, TOKENIZER_LENGTH:],
                for_dtype(torch.float32), what="draft logits of the padding rows (ids the tokenizer never produces)")

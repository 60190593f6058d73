"""The slot layout (#33, `sample_from_anchor`): how many tokens a block proposes, which slots' logits propose
them at decoding time, and the targets, loss mask and loss weights training gives the drafter's layout."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from conformance.checks import losses, training
from conformance.comparator import Comparator
from conformance.strategies import TrainingCase
from conformance.tolerances import EXACT, for_dtype
from conformance.world import reference_state_dict, target_for
from impl.recipe import DEFAULTS
from impl.spec import DraftSpec

FP32 = for_dtype(torch.float32)


@dataclass(frozen=True)
class SlotCase:
    spec: DraftSpec  # its `sample_from_anchor` is the layout under test
    context_len: int
    seed: int


def speculative_tokens(cmp: Comparator, a, b, block_size: int, sample_from_anchor: bool) -> None:
    cmp.compare((a.name, b.name), lambda: a.speculative_tokens(block_size, sample_from_anchor),
                lambda: b.speculative_tokens(block_size, sample_from_anchor), EXACT,
                what=f"speculative tokens of a block of {block_size}, sample_from_anchor={sample_from_anchor}")


def proposal_logits(impl, case: SlotCase) -> torch.Tensor:
    target = target_for(case.spec)
    gen = torch.Generator().manual_seed(case.seed)
    input_ids = torch.randint(0, case.spec.target_vocab_size - 1, (1, case.context_len + 1), generator=gen)
    drafter = impl.build_drafter(case.spec, reference_state_dict(case.spec, case.seed), target)
    with torch.no_grad():
        return impl.proposal_logits(drafter, target, input_ids)


def proposals(cmp: Comparator, a, b, case: SlotCase) -> None:
    """Which slots propose, in which order, from which logits: one block with the same weights and context.
    A decoder that reads the anchor slot under the anchor-as-bonus layout (or skips it under
    sample-from-anchor) proposes from other rows, or another number of them."""
    names, layout = (a.name, b.name), case.spec.sample_from_anchor
    ok_a, out_a = cmp.run(names, lambda: proposal_logits(a, case), what="one drafted block's proposal logits")
    ok_b, out_b = cmp.run(names, lambda: proposal_logits(b, case), what="one drafted block's proposal logits")
    if not (ok_a and ok_b):
        return
    cmp.compare(names, out_a.shape[0], out_b.shape[0], EXACT,
                what=f"proposals per block of {case.spec.block_size}, sample_from_anchor={layout}")
    cmp.compare(names, out_a, out_b, FP32, what=f"logits of each proposal, in order, sample_from_anchor={layout}")


def trained_layout(cmp: Comparator, a, b, case: TrainingCase, gamma: float = DEFAULTS["gamma"]) -> None:
    """Training under the drafter's own layout: which positions' logits each slot is trained toward, the
    aligned loss mask (the anchor slot trained or not) and the per-slot loss weights."""
    training.target_alignment(cmp, a, b, case)
    losses.loss_weights(cmp, a, b, (case.spec.block_size, gamma, case.spec.sample_from_anchor))

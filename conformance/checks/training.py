"""Checks on one training forward (`training_outputs`) of a packed sequence.

Both implementations get the same real target, the reference's draft-body weights, the
same packed documents and the same anchor seed; then targets (#3), their alignment (#5),
anchors (#8), the forward through the training masks (#9), positions (#12), borrowed
embeddings / head (#13), the mask token (#14) and noise (#15) are compared.
"""

from __future__ import annotations

import copy
import dataclasses

import torch

from conformance.compare import Comparator
from conformance.strategies import TrainingCase
from conformance.tolerances import EXACT, for_dtype
from conformance.world import packed_sequence, reference_state_dict, target_for

FP32 = for_dtype(torch.float32)


def run(impl, case: TrainingCase):
    spec = case.spec
    target = target_for(spec)
    input_ids, loss_mask, document_ids = packed_sequence(list(case.lengths), case.padding, case.seed)
    drafter = impl.build_drafter(spec, reference_state_dict(spec, case.seed), target)
    with torch.no_grad():
        return impl.training_outputs(drafter, target, input_ids, loss_mask, document_ids, case.max_anchors, case.seed)


def _target_logits(case: TrainingCase) -> torch.Tensor:
    """[T, V]: the target's own logits (transformers applies the final norm once, then the head)."""
    input_ids, _, _ = packed_sequence(list(case.lengths), case.padding, case.seed)
    with torch.no_grad():
        return target_for(case.spec)(input_ids).logits[0]


def _matched_positions(targets: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """For each slot, the sequence position whose target logits its training target is closest to."""
    return torch.cdist(targets[0].double(), logits.double()).argmin(-1)


def targets_source(cmp: Comparator, a, b, case: TrainingCase) -> None:
    """Every training target must BE the verifier's logits at some position: final layer, normalised once."""
    logits = _target_logits(case)
    for impl in (a, b):
        out = run(impl, case)
        rows = logits[_matched_positions(out.targets, logits)]
        cmp.compare((impl.name, "transformers"), out.targets[0], rows, FP32,
                    what="training targets vs the target model's own logits (nearest position)")


def target_alignment(cmp: Comparator, a, b, case: TrainingCase) -> None:
    """Which position's logits each slot is trained toward (slot k <- a + k - 1), and the aligned loss mask."""
    logits = _target_logits(case)
    offsets = {}
    for impl in (a, b):
        out = run(impl, case)
        slots = out.anchors.reshape(-1, 1) + torch.arange(case.spec.block_size)
        valid = out.anchor_valid.reshape(-1, 1).expand_as(slots)
        shift = _matched_positions(out.targets, logits).reshape(slots.shape) - slots
        offsets[impl.name] = (torch.where(valid, shift, 0), out.loss_mask.reshape(slots.shape))
    (a_shift, a_mask), (b_shift, b_mask) = offsets[a.name], offsets[b.name]
    cmp.compare((a.name, b.name), a_shift, b_shift, EXACT,
                what="position of the target logits minus the slot's position, per [anchor, slot]")
    cmp.compare((a.name, b.name), a_mask, b_mask, EXACT, what="aligned loss mask")


def training_anchors(cmp: Comparator, a, b, case: TrainingCase) -> None:
    out_a, out_b = run(a, case), run(b, case)
    cmp.compare((a.name, b.name), out_a.anchors, out_b.anchors, EXACT, what="anchors drawn in training")
    cmp.compare((a.name, b.name), out_a.anchor_valid, out_b.anchor_valid, EXACT, what="anchor validity")
    block = case.spec.block_size
    invalid_a = out_a.loss_mask.reshape(-1, block)[~out_a.anchor_valid.reshape(-1)]
    cmp.compare((a.name, b.name), invalid_a, torch.zeros_like(invalid_a), EXACT,
                what="loss mask of invalid (padded) anchor blocks")


def training_forward(cmp: Comparator, a, b, case: TrainingCase) -> None:
    """Draft hidden states and logits of the whole training forward (masks, positions, embeddings, mask token)."""
    out_a, out_b = run(a, case), run(b, case)
    cmp.compare((a.name, b.name), out_a.hidden, out_b.hidden, FP32,
                what="training-layout draft hidden states")
    cmp.compare((a.name, b.name), out_a.logits, out_b.logits, FP32,
                what="training-layout draft logits (borrowed LM head)")


def noise_stays_out_of_targets(cmp: Comparator, a, b, case: TrainingCase) -> None:
    """With input noise switched on (where the implementation has a recipe), targets stay the clean ones."""
    noisy = a
    if dataclasses.is_dataclass(getattr(a, "recipe", None)) and hasattr(a.recipe, "noise_std"):
        noisy = copy.copy(a)
        noisy.recipe = dataclasses.replace(a.recipe, noise_std=0.5)
    cmp.compare((a.name, b.name), run(noisy, case).targets, run(b, case).targets, FP32,
                what="training targets with hidden-state noise on the drafter's inputs")

"""Checks on one training forward (`training_outputs`) of a packed sequence.

Both implementations get the same real target, the reference's draft-body weights and the
same packed documents; the reference draws the anchors and the implementation under test
trains on those same anchors (anchors themselves are compared by #8 alone); then targets (#3), their alignment (#5),
anchors (#8), the forward through the training masks (#9), positions (#12), borrowed
embeddings / head (#13), the mask token (#14) and noise (#15) are compared.
"""

from __future__ import annotations

import copy
import dataclasses

import torch

from conformance.comparator import Comparator
from conformance.strategies import TrainingCase
from conformance.tolerances import EXACT, for_dtype
from conformance.world import packed_sequence, reference_state_dict, target_for
from impl.recipe import Recipe

FP32 = for_dtype(torch.float32)


def run(impl, case: TrainingCase, anchors: tuple[torch.Tensor, torch.Tensor] | None = None):
    spec = case.spec
    target = target_for(spec)
    input_ids, loss_mask, document_ids = packed_sequence(list(case.lengths), case.padding, case.seed)
    drafter = impl.build_drafter(spec, reference_state_dict(spec, case.seed), target)
    given = {} if anchors is None else {"anchors": anchors}
    with torch.no_grad():
        return impl.training_outputs(drafter, target, input_ids, loss_mask, document_ids, case.max_anchors, case.seed,
                                     **given)


def on_reference_anchors(cmp: Comparator, a, b, case: TrainingCase):
    """`(out_a, out_b)`: `b` (the reference) draws its anchors, `a` trains on those same anchors, so a
    check downstream of the anchors sees only its own component (anchors are #8's). None once n/a."""
    names = (a.name, b.name)
    ok, out_b = cmp.run(names, lambda: run(b, case), what="training forward")
    if not ok:
        return None
    ok, out_a = cmp.run(names, lambda: run(a, case, (out_b.anchors, out_b.anchor_valid)),
                        what="training forward on the reference's anchors")
    return (out_a, out_b) if ok else None


def _target_logits(case: TrainingCase) -> torch.Tensor:
    """[T, V]: the target's own logits (transformers applies the final norm once, then the head)."""
    input_ids, _, _ = packed_sequence(list(case.lengths), case.padding, case.seed)
    with torch.no_grad():
        return target_for(case.spec)(input_ids).logits[0]


def _matched_positions(targets: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """For each slot, the sequence position whose target logits its training target is closest to."""
    return torch.cdist(targets[0].double(), logits.double()).argmin(-1)


def _hard_labels(out) -> bool:
    return out.targets is None and out.target_ids is not None


def targets_source(cmp: Comparator, a, b, case: TrainingCase) -> None:
    """Every training target must BE the verifier's logits at some position: final layer, normalised once.
    Hard labels (a CE-only trainer) are held to what the reference's CE trains on: the argmax of those logits."""
    logits = _target_logits(case)
    outs = on_reference_anchors(cmp, a, b, case)
    if outs is None:
        return
    reference = outs[1]
    for impl, out in zip((a, b), outs):
        if _hard_labels(out):
            trained = reference.loss_mask[0] > 0
            expected = logits[_matched_positions(reference.targets, logits)].argmax(-1)
            cmp.compare((impl.name, b.name), out.target_ids[0][trained], expected[trained], EXACT,
                        what="hard labels vs the argmax of the verifier logits the reference trains toward, "
                             "on the slots the reference trains")
            continue
        cmp.compare((impl.name, "transformers"), lambda out=out: out.get("targets")[0],
                    lambda out=out: logits[_matched_positions(out.get("targets"), logits)], FP32,
                    what="training targets vs the target model's own logits (nearest position)")


def target_alignment(cmp: Comparator, a, b, case: TrainingCase) -> None:
    """Which position's logits each slot is trained toward (slot k <- a + k - 1), and the aligned loss mask.
    Hard labels are aligned when each is the data token that the reference's target logits predict."""
    logits = _target_logits(case)
    outs = on_reference_anchors(cmp, a, b, case)
    if outs is None:
        return
    out_a, out_b = outs
    slots = out_b.anchors.reshape(-1, 1) + torch.arange(case.spec.block_size)
    valid = out_b.anchor_valid.reshape(-1, 1).expand_as(slots)
    b_position = _matched_positions(out_b.targets, logits)
    if _hard_labels(out_a):
        input_ids, _, _ = packed_sequence(list(case.lengths), case.padding, case.seed)
        trained = (out_b.loss_mask[0] > 0) & (b_position + 1 < input_ids.shape[1])
        cmp.compare((a.name, b.name), out_a.target_ids[0][trained], input_ids[0][b_position[trained] + 1], EXACT,
                    what="hard label of each trained slot vs the data token its reference target logits predict")
    else:
        shift = {name: torch.where(valid, _matched_positions(out.targets, logits).reshape(slots.shape) - slots, 0)
                 for name, out in ((a.name, out_a), (b.name, out_b))}
        cmp.compare((a.name, b.name), shift[a.name], shift[b.name], EXACT,
                    what="position of the target logits minus the slot's position, per [anchor, slot]")
    cmp.compare((a.name, b.name), out_a.loss_mask.reshape(slots.shape), out_b.loss_mask.reshape(slots.shape), EXACT,
                what="aligned loss mask")


def training_anchors(cmp: Comparator, a, b, case: TrainingCase) -> None:
    """Anchors as each implementation draws them in training (the one check that does not share them)."""
    names = (a.name, b.name)
    ok_a, out_a = cmp.run(names, lambda: run(a, case), what="training forward")
    ok_b, out_b = cmp.run(names, lambda: run(b, case), what="training forward")
    if not (ok_a and ok_b):
        return
    cmp.compare(names, out_a.anchors, out_b.anchors, EXACT, what="anchors drawn in training")
    cmp.compare(names, out_a.anchor_valid, out_b.anchor_valid, EXACT, what="anchor validity")
    block = case.spec.block_size
    invalid_a = out_a.loss_mask.reshape(-1, block)[~out_a.anchor_valid.reshape(-1)]
    cmp.compare(names, invalid_a, torch.zeros_like(invalid_a), EXACT,
                what="loss mask of invalid (padded) anchor blocks")


def training_forward(cmp: Comparator, a, b, case: TrainingCase) -> None:
    """Draft hidden states and logits of the whole training forward on the reference's anchors
    (masks, positions, embeddings, mask token)."""
    outs = on_reference_anchors(cmp, a, b, case)
    if outs is None:
        return
    out_a, out_b = outs
    # Padded anchor blocks are masked out of the loss (#8): what a drafter computes there trains nothing.
    valid = out_b.anchor_valid.reshape(-1).repeat_interleave(case.spec.block_size)
    cmp.compare((a.name, b.name), lambda: out_a.get("hidden")[:, valid], lambda: out_b.get("hidden")[:, valid], FP32,
                what="training-layout draft hidden states of the valid anchor blocks")
    cmp.compare((a.name, b.name), out_a.logits[:, valid], out_b.logits[:, valid], FP32,
                what="training-layout draft logits (borrowed LM head) of the valid anchor blocks")


def noise_stays_out_of_targets(cmp: Comparator, a, b, case: TrainingCase) -> None:
    """With input noise switched on, targets stay the clean ones (n/a for an implementation with no noise)."""
    recipe = getattr(a, "recipe", None)
    if not ((isinstance(recipe, Recipe) or dataclasses.is_dataclass(recipe)) and hasattr(recipe, "noise_std")):
        cmp.not_applicable((a.name, b.name), f"{a.name} has no hidden-state noise (no recipe noise_std)")
        return
    noisy = copy.copy(a)
    noisy.recipe = (recipe.replace(noise_std=0.5) if isinstance(recipe, Recipe)
                    else dataclasses.replace(recipe, noise_std=0.5))
    outs = on_reference_anchors(cmp, noisy, b, case)
    if outs is None:
        return
    cmp.compare((a.name, b.name), lambda: outs[0].get("targets"), lambda: outs[1].get("targets"), FP32,
                what="training targets with hidden-state noise on the drafter's inputs")

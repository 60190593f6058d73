"""DSpark's and XPress's training losses (#37, #38): every loss term and the total of one training forward, ours
against speculators' own model forward, on the same weights, sequence, anchors and recipe."""

from __future__ import annotations

import torch

from conformance.comparator import Comparator
from conformance.plug import require
from conformance.strategies import FamilyLossCase
from conformance.tolerances import EXACT, for_dtype
from conformance.world import packed_sequence, reference_state_dict, target_for

FP32 = for_dtype(torch.float32)


def _where(case: FamilyLossCase) -> str:
    recipe, spec = case.recipe, case.training.spec
    common = (f"{spec.family}, B={spec.block_size}, sample_from_anchor {spec.sample_from_anchor}, loss_fn "
              f"{recipe.loss_fn}, {recipe.per_position_loss_weight}")
    if spec.family == "dspark":
        return f"{common}, {spec.markov_head_type} rank {spec.markov_rank}, confidence_head_alpha " \
               f"{recipe.confidence_head_alpha:g}"
    return (f"{common}, consistency {recipe.consistency_weight:g} x {recipe.consistency_passes} rounds, base anchor "
            f"{recipe.base_anchor_weight:g}{' unweighted' if recipe.base_anchor_full_weight else ''}"
            f"{', ce from data' if recipe.ce_from_data else ''}")


def loss_terms(cmp: Comparator, a, b, case: FamilyLossCase) -> None:
    """The names of the terms, then each term (the total included) within fp32 rounding."""
    training = case.training
    spec, target = training.spec, target_for(training.spec)
    input_ids, loss_mask, document_ids = packed_sequence(list(training.lengths), training.padding, training.seed)
    anchors = b.select_anchors(loss_mask, training.max_anchors, spec.block_size, training.seed)

    def run(impl):
        require(impl, "family_loss")
        drafter = impl.build_drafter(spec, reference_state_dict(spec, training.seed), target)
        with torch.no_grad():
            return impl.family_loss(drafter, target, input_ids, loss_mask, document_ids, case.recipe, training.seed,
                                    anchors=anchors)

    names, where = (a.name, b.name), _where(case)
    ok_a, terms_a = cmp.run(names, lambda: run(a), what=f"training loss terms, {where}")
    ok_b, terms_b = cmp.run(names, lambda: run(b), what=f"training loss terms, {where}")
    if not (ok_a and ok_b):
        return
    cmp.compare(names, sorted(terms_a), sorted(terms_b), EXACT, what=f"the loss terms, {where}")
    for name in sorted(terms_b):
        cmp.compare(names, lambda name=name: terms_a[name], terms_b[name], FP32, what=f"{name}, {where}")

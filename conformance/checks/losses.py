"""Loss weights and reduction (#6), loss kinds (#7), per-position accuracy and EAL (#17)."""

from __future__ import annotations

import torch

from conformance.comparator import Comparator
from conformance.plug import recipe_field
from conformance.strategies import DPaceCase, LossCase
from conformance.tolerances import EXACT, for_dtype


def loss_weights(cmp: Comparator, a, b, case: tuple[int, float, bool]) -> None:
    block_size, gamma, sample_from_anchor = case
    cmp.compare((a.name, b.name), lambda: a.loss_weights(block_size, gamma, sample_from_anchor),
                lambda: b.loss_weights(block_size, gamma, sample_from_anchor), EXACT,
                what=f"per-slot weights B={block_size}, gamma={gamma}, sample_from_anchor={sample_from_anchor}")


def speculators_trainer_defaults() -> dict:
    """The recipe `speculators train --speculator-type dflash` runs when not told otherwise: its
    TrainConfig resolved and handed to `get_trainer_kwargs`, as speculators' CLI does."""
    from reference_adapters.speculators_recipe import trainer

    return trainer("dflash").recipe.to_dict()


def recipe_defaults(cmp: Comparator, a, fields: tuple[str, ...]) -> None:
    """The implementation's default training recipe vs speculators' TrainConfig-resolved dflash recipe
    (n/a for an implementation that has no recipe, e.g. an inference-only one)."""
    if not hasattr(a, "recipe"):
        cmp.not_applicable((a.name, "speculators"), "no training recipe to compare")
        return
    reference = speculators_trainer_defaults()
    for name in fields:
        cmp.compare((a.name, "speculators"), lambda name=name: recipe_field(a, name), reference[name], EXACT,
                    what=f"default training recipe {name} vs speculators' TrainConfig-resolved dflash recipe")


def dpace_weights(cmp: Comparator, a, b, case: DPaceCase) -> None:
    """Per-slot D-PACE weights, exactly: the same elementwise ops, cumprod and cumsum in fp32."""
    args = (case.per_slot_loss, case.loss_mask, case.block_size, case.alpha)
    cmp.compare((a.name, b.name), lambda: a.dpace_weights(*args), lambda: b.dpace_weights(*args),
                EXACT, what=f"D-PACE weights B={case.block_size}, alpha={case.alpha}, "
                            f"loss dtype {case.per_slot_loss.dtype}")


def dpace_loss(cmp: Comparator, a, b, case: LossCase, alpha: float) -> None:
    """The D-PACE-weighted CE loss and its gradient w.r.t. the drafter's logits.

    The gradient also proves the weights are constants: weights left in the graph add a term."""
    logits, targets, loss_mask = case.tensors()
    tol = for_dtype(case.dtype)  # speculators' eager CE runs in the logits' dtype, ours upcasts

    def loss_and_grad(impl):
        leaf = logits.detach().clone().requires_grad_(True)
        loss = impl.dpace_loss(leaf, targets, loss_mask, case.block_size, alpha)
        (grad,) = torch.autograd.grad(loss, leaf)
        return loss.detach(), grad

    what = f"D-PACE-weighted CE, B={case.block_size}, alpha={alpha}, {case.dtype}"
    ok_a, out_a = cmp.run((a.name, b.name), lambda: loss_and_grad(a), what=what)
    ok_b, out_b = cmp.run((a.name, b.name), lambda: loss_and_grad(b), what=what)
    if not (ok_a and ok_b):
        return
    (la, ga), (lb, gb) = out_a, out_b
    cmp.compare((a.name, b.name), la, lb, tol, what=f"{what}: loss")
    cmp.compare((a.name, b.name), ga, gb, tol, what=f"{what}: gradient w.r.t. the logits")


def loss_value(cmp: Comparator, a, b, case: LossCase) -> None:
    logits, targets, loss_mask = case.tensors()
    args = (logits, targets, loss_mask, case.block_size, case.gamma, case.kind, case.sample_from_anchor)
    # The tolerance of the inputs' dtype: speculators' eager CE computes in bf16 on bf16 logits, ours
    # upcasts (measured |Δ| 5e-5 on a loss of 1.57), which is rounding, not a rule (see tolerances.py).
    cmp.compare((a.name, b.name), lambda: a.loss(*args), lambda: b.loss(*args),
                for_dtype(case.dtype), what=f"{case.kind} loss with speculators' reduction")


def block_metrics(cmp: Comparator, a, b, case: LossCase) -> None:
    logits, targets, loss_mask = case.tensors()
    args = (logits, targets, loss_mask, case.block_size)
    ok_a, ma = cmp.run((a.name, b.name), lambda: a.block_metrics(*args), what="block metrics")
    ok_b, mb = cmp.run((a.name, b.name), lambda: b.block_metrics(*args), what="block metrics")
    if not (ok_a and ok_b):
        return
    tol = for_dtype(torch.float32)
    cmp.compare((a.name, b.name), ma["position_acc"], mb["position_acc"], tol,
                what="per-position accuracy of slots 1..B-1")
    cmp.compare((a.name, b.name), ma["eal"], mb["eal"], tol, what="EAL (accepted run + bonus)")

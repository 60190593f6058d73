"""Loss weights and reduction (#6), loss kinds (#7), per-position accuracy and EAL (#17)."""

from __future__ import annotations

import torch

from conformance.compare import Comparator
from conformance.strategies import LossCase
from conformance.tolerances import EXACT, for_dtype


def loss_weights(cmp: Comparator, a, b, case: tuple[int, float, bool]) -> None:
    block_size, gamma, sample_from_anchor = case
    cmp.compare("loss_weights", 6, (a.name, b.name), lambda: a.loss_weights(block_size, gamma, sample_from_anchor),
                lambda: b.loss_weights(block_size, gamma, sample_from_anchor), EXACT,
                what=f"per-slot weights B={block_size}, gamma={gamma}, sample_from_anchor={sample_from_anchor}")


def speculators_trainer_defaults() -> dict:
    """gamma / loss kind / max anchors the speculators trainer uses when not told otherwise."""
    from speculators.models.dflash import DFlashDraftModel

    train, _ = DFlashDraftModel.get_trainer_kwargs(loss_fn="kl_div", loss_implementation="eager")
    from speculators.models.dflash.metrics import _DEFAULT_LOSS_CONFIG

    return {"gamma": train["gamma"], "max_anchors": train["max_anchors"],
            "loss_kind": next(iter(_DEFAULT_LOSS_CONFIG))}


def recipe_defaults(cmp: Comparator, a, component: str, pitfall: int, fields: tuple[str, ...]) -> None:
    """The implementation's default training recipe vs speculators' trainer defaults."""
    reference = speculators_trainer_defaults()
    for name in fields:
        cmp.compare(component, pitfall, (a.name, "speculators"), getattr(a.recipe, name), reference[name], EXACT,
                    what=f"default training recipe {name} vs speculators' trainer default")


def loss_value(cmp: Comparator, a, b, case: LossCase, component: str, pitfall: int) -> None:
    logits, targets, loss_mask = case.tensors()
    args = (logits, targets, loss_mask, case.block_size, case.gamma, case.kind, case.sample_from_anchor)
    cmp.compare(component, pitfall, (a.name, b.name), lambda: a.loss(*args), lambda: b.loss(*args),
                for_dtype(torch.float32), what=f"{case.kind} loss with speculators' reduction")


def block_metrics(cmp: Comparator, a, b, case: LossCase) -> None:
    logits, targets, loss_mask = case.tensors()
    args = (logits, targets, loss_mask, case.block_size)
    ma, mb = a.block_metrics(*args), b.block_metrics(*args)
    tol = for_dtype(torch.float32)
    cmp.compare("tau", 17, (a.name, b.name), ma["position_acc"], mb["position_acc"], tol,
                what="per-position accuracy of slots 1..B-1")
    cmp.compare("tau", 17, (a.name, b.name), ma["eal"], mb["eal"], tol, what="EAL (accepted run + bonus)")

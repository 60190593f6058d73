"""The training losses of DSpark and XPress, as speculators 0.9.0 composes them (models/dspark/metrics.py,
models/xpress/metrics.py), each term under speculators' metric name.

DSpark:  loss = compound(loss_fn)(markov-corrected logits) + confidence_head_alpha * confidence_loss
         confidence_loss: BCE of the confidence logits toward the slot's acceptance rate 1 - TV(draft, target)
         (no gradient through the rate), always fixed-decay weighted (D-PACE expects a CE), reduced with eps 1e-8.
XPress:  loss = tf_loss + consistency_weight * mean_j consistency_round{j}_loss + base_anchor_weight * base_anchor_loss
         tf_loss on the teacher-forced refined logits, each round's on that round's refined logits, the anchor term
         on the backbone's own logits (mask only with base_anchor_full_weight). With ce_from_data the ce term trains
         toward the data's tokens (hard labels, eps 1e-8) instead of the verifier's argmax.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from impl import losses
from impl.recipe import Recipe, loss_terms


@dataclass
class FamilyTraining:
    """What a DSpark or XPress training forward adds to the DFlash one, all rows [b, A*B, ...]."""

    confidence_logits: torch.Tensor | None = None  # DSpark: [b, A*B]
    round_logits: list[torch.Tensor] = field(default_factory=list)  # XPress: each round's refined logits
    base_logits: torch.Tensor | None = None  # XPress: the backbone's own logits (the anchor term's)
    data_labels: torch.Tensor | None = None  # XPress: [b, A*B] the data token each slot proposes


def _weighting(recipe: Recipe) -> str:
    return recipe.per_position_loss_weight


def dspark_loss(logits: torch.Tensor, targets: torch.Tensor, confidence_logits: torch.Tensor | None,
                loss_mask: torch.Tensor, block_size: int, recipe: Recipe,
                sample_from_anchor: bool) -> dict[str, torch.Tensor]:
    """{"loss": total, "confidence_loss": ..., "<name>_loss": ... (several loss_fn terms)}."""
    total, terms = losses.compound_loss(logits, targets, loss_mask, block_size, recipe.loss_fn, recipe.gamma,
                                        sample_from_anchor, _weighting(recipe), recipe.dpace_alpha)
    out = {}
    if confidence_logits is not None:
        with torch.no_grad():
            accept_rate = acceptance_rate(logits, targets)
        bce = F.binary_cross_entropy_with_logits(confidence_logits, accept_rate.to(confidence_logits.dtype),
                                                 reduction="none")
        decay = losses.decay_weights(block_size, recipe.gamma, sample_from_anchor, device=bce.device)
        confidence = losses.reduce_loss(bce, loss_mask, decay, eps=losses.HEAD_REDUCTION_EPS)
        total = total + recipe.confidence_head_alpha * confidence
        out["confidence_loss"] = confidence
    return {"loss": total, **out, **terms}


def acceptance_rate(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """[b, N] each slot's analytical acceptance rate under rejection sampling: sum min(q, p) = 1 - TV."""
    return 1.0 - losses.elementwise_loss(logits, targets, "tv")


def consistency_loss(rounds: list[torch.Tensor]) -> torch.Tensor:
    """The rounds' losses averaged, so consistency_weight means the same for any number of rounds."""
    return torch.stack(rounds).mean()


def _term_loss(logits: torch.Tensor, targets: torch.Tensor, loss_mask: torch.Tensor, block_size: int,
               recipe: Recipe, sample_from_anchor: bool, weighting: str | None,
               data_labels: torch.Tensor | None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One XPress term: loss_fn's compound loss, its ce toward the data's tokens when `data_labels` is given."""
    terms = loss_terms(recipe.loss_fn)
    if data_labels is None or "ce" not in terms:
        return losses.compound_loss(logits, targets, loss_mask, block_size, recipe.loss_fn, recipe.gamma,
                                    sample_from_anchor, weighting, recipe.dpace_alpha)
    soft = {name: weight for name, weight in terms.items() if name != "ce"}
    named = {}
    total = torch.zeros((), dtype=torch.float32, device=logits.device)
    if soft:
        total, named = losses.compound_loss(logits, targets, loss_mask, block_size, json.dumps(soft), recipe.gamma,
                                            sample_from_anchor, weighting, recipe.dpace_alpha)
        if not named:  # one soft term: speculators names it anyway, its weight divided out
            (name, weight), = soft.items()
            named[f"{name}_loss"] = total.detach() / weight if weight else total.detach()
    per_slot = losses.hard_label_ce(logits, data_labels)
    masked = per_slot * loss_mask.to(per_slot.dtype)
    weights = None if weighting is None else losses.slot_weights(
        masked, loss_mask, block_size, recipe.gamma, sample_from_anchor, weighting, recipe.dpace_alpha)
    ce = losses.reduce_loss(per_slot, loss_mask, weights, eps=losses.HEAD_REDUCTION_EPS)
    named["ce_loss"] = ce.detach()
    return total + terms["ce"] * ce, named


def xpress_loss(refined: torch.Tensor, family: FamilyTraining, targets: torch.Tensor, loss_mask: torch.Tensor,
                block_size: int, recipe: Recipe, sample_from_anchor: bool) -> dict[str, torch.Tensor]:
    """{"loss", "tf_loss", "consistency_loss", "consistency_round{j}_loss", "base_anchor_loss", "<name>_loss"}."""
    labels = family.data_labels if recipe.ce_from_data else None
    weighting = _weighting(recipe)

    def term(logits, term_weighting):
        return _term_loss(logits, targets, loss_mask, block_size, recipe, sample_from_anchor, term_weighting, labels)

    tf_loss, named = term(refined, weighting)
    total, out = tf_loss, {"tf_loss": tf_loss}
    rounds = [term(logits, weighting)[0] for logits in family.round_logits]
    if rounds:
        consistency = consistency_loss(rounds)
        total = total + recipe.consistency_weight * consistency
        out["consistency_loss"] = consistency
        out.update({f"consistency_round{j}_loss": loss for j, loss in enumerate(rounds)})
    if family.base_logits is not None:
        base = term(family.base_logits, None if recipe.base_anchor_full_weight else weighting)[0]
        total = total + recipe.base_anchor_weight * base
        out["base_anchor_loss"] = base
    return {"loss": total, **out, **named}

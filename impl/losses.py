"""Per-slot loss weights (fixed exponential decay, D-PACE), loss kinds, weighted sums of them and speculators'
reduction."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from impl.recipe import DEFAULTS, loss_terms  # the recipe's declared defaults (model-level: KL, fixed decay)
from impl.slot_layout import first_proposing_slot


def decay_weights(block_size: int, gamma: float = DEFAULTS["gamma"], sample_from_anchor: bool = False,
                  device: torch.device | None = None) -> torch.Tensor:
    """[B] weights: DFlash w(0) = 0, w(k) = exp(-(k-1)/gamma); sample-from-anchor w(k) = exp(-k/gamma)."""
    k = torch.arange(block_size, dtype=torch.float32, device=device)
    if sample_from_anchor:
        return torch.exp(-k / gamma)
    return torch.exp(-(k - 1).clamp(min=0) / gamma) * (k != 0)


def elementwise_loss(logits: torch.Tensor, targets: torch.Tensor, loss_fn: str = DEFAULTS["loss_fn"]) -> torch.Tensor:
    """[1, N] per-slot loss: KL(target || draft), CE against the target's argmax, or TV = 1 - sum min(q, p)."""
    if loss_fn == "kl_div":
        log_q = F.log_softmax(logits, dim=-1, dtype=torch.float32)
        p = F.softmax(targets, dim=-1, dtype=torch.float32)
        return F.kl_div(log_q, p, reduction="none").sum(-1)
    if loss_fn == "ce":
        labels = targets.argmax(-1)
        return hard_label_ce(logits, labels)
    if loss_fn == "tv":
        q = F.softmax(logits, dim=-1, dtype=torch.float32)
        p = F.softmax(targets, dim=-1, dtype=torch.float32)
        return 1.0 - torch.minimum(q, p).sum(-1)
    raise ValueError(f"loss_fn: unknown loss {loss_fn!r}; expected 'kl_div', 'ce' or 'tv'")


def hard_label_ce(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """[b, N] CE of logits [b, N, V] against token ids [b, N], in fp32."""
    return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), reduction="none").view(labels.shape)


# -- D-PACE ---------------------------------------------------------------------------------
# Per block, slot k's weight is the expected number of accepted tokens its success unlocks:
# w_k = m_k * sum_{j >= k} m_j * prod_{i <= j, m_i} s_i, with s_i = (1 - alpha) q_i + alpha the
# smoothed confidence q_i = exp(-CE_i) and m the loss mask (slot 0 and padding untrained).
def confidence(per_slot_loss: torch.Tensor) -> torch.Tensor:
    """q = exp(-CE) in the loss's own dtype, then fp32 (as speculators: bf16 losses round the same)."""
    return torch.exp(-per_slot_loss).float()


def smoothed_confidence(q: torch.Tensor, dpace_alpha: float) -> torch.Tensor:
    """(1 - dpace_alpha) q + dpace_alpha: dpace_alpha = 1 gives every trained slot one full expected token."""
    return (1.0 - dpace_alpha) * q + dpace_alpha


def suffix_sum(x: torch.Tensor) -> torch.Tensor:
    """sum_{j >= k} x_j along the last dim: slot k is credited with what every later slot adds."""
    return torch.flip(torch.cumsum(torch.flip(x, dims=[-1]), dim=-1), dims=[-1])


def dpace_weights(per_slot_loss: torch.Tensor, loss_mask: torch.Tensor, block_size: int,
                  dpace_alpha: float = DEFAULTS["dpace_alpha"]) -> torch.Tensor:
    """[b, A*B] D-PACE weights. Detached: they reweight the loss and carry no gradient of their own."""
    return dpace_weights_of(per_slot_loss.detach(), loss_mask, block_size, dpace_alpha)


def dpace_weights_of(per_slot_loss: torch.Tensor, loss_mask: torch.Tensor, block_size: int,
                     dpace_alpha: float) -> torch.Tensor:
    if per_slot_loss.shape[-1] % block_size:
        raise ValueError(f"{per_slot_loss.shape[-1]} slots are not whole blocks of {block_size}")
    q = confidence(per_slot_loss).reshape(-1, block_size)
    trained = loss_mask.reshape(-1, block_size).to(q.dtype)
    # An untrained slot neither gates nor discounts the slots after it.
    smooth = torch.where(trained > 0, smoothed_confidence(q, dpace_alpha), torch.ones_like(q))
    prefix = torch.cumprod(smooth, dim=-1)
    return (suffix_sum(prefix * trained) * trained).reshape(per_slot_loss.shape)


# speculators' reduction epsilons: its loss_function's, and the one of DSpark's confidence BCE and XPress's
# hard-label CE (models/dspark/metrics.py _EPS, models/xpress/metrics.py _hard_label_ce).
REDUCTION_EPS = 1e-5
HEAD_REDUCTION_EPS = 1e-8


def reduce_loss(per_slot: torch.Tensor, loss_mask: torch.Tensor, weights: torch.Tensor | None,
                eps: float = REDUCTION_EPS) -> torch.Tensor:
    """sum(w * mask * loss) / (sum(mask) + eps) per sequence, then the mean.

    `weights` is one block's schedule [B], per-slot weights shaped like `per_slot` (D-PACE), or None (mask only).
    The denominator counts masked slots, not weights (speculators' reduction).
    """
    mask = loss_mask.to(per_slot.dtype)
    weighted = per_slot * mask
    if weights is not None:
        if weights.dim() == 1:
            weights = weights.repeat(per_slot.shape[1] // weights.numel())[None]
        weighted = weighted * weights
    return (weighted.sum(dim=1) / (mask.sum(dim=1) + eps)).mean()


def slot_weights(per_slot: torch.Tensor, loss_mask: torch.Tensor, block_size: int, gamma: float,
                 sample_from_anchor: bool, per_position_loss_weight: str, dpace_alpha: float) -> torch.Tensor:
    """The per-slot weights of `per_position_loss_weight`: one block's fixed decay [B], or D-PACE's from
    `per_slot` itself."""
    if per_position_loss_weight == "dpace":
        return dpace_weights(per_slot, loss_mask, block_size, dpace_alpha)
    if per_position_loss_weight == "fixed-exp-decay":
        return decay_weights(block_size, gamma, sample_from_anchor, device=per_slot.device)
    raise ValueError(f"per_position_loss_weight: unknown {per_position_loss_weight!r}")


def dflash_loss(logits: torch.Tensor, targets: torch.Tensor, loss_mask: torch.Tensor, block_size: int,
                gamma: float = DEFAULTS["gamma"], loss_fn: str = DEFAULTS["loss_fn"], sample_from_anchor: bool = False,
                per_position_loss_weight: str = DEFAULTS["per_position_loss_weight"],
                dpace_alpha: float = DEFAULTS["dpace_alpha"]) -> torch.Tensor:
    return compound_loss(logits, targets, loss_mask, block_size, loss_fn, gamma, sample_from_anchor,
                         per_position_loss_weight, dpace_alpha)[0]


def compound_loss(logits: torch.Tensor, targets: torch.Tensor, loss_mask: torch.Tensor, block_size: int,
                  loss_fn: str, gamma: float, sample_from_anchor: bool, per_position_loss_weight: str | None,
                  dpace_alpha: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(sum of weight * term, {"<name>_loss": term} when there are several terms): each term of `loss_fn` weighted
    per slot and reduced on its own, D-PACE's weights from that term's own per-slot loss (speculators'
    `compound_loss`). `per_position_loss_weight` None: mask only, no per-slot weights."""
    total = torch.zeros((), dtype=torch.float32, device=logits.device)
    terms = loss_terms(loss_fn)
    named = {}
    for name, weight in terms.items():
        per_slot = elementwise_loss(logits, targets, name)
        weights = None if per_position_loss_weight is None else slot_weights(
            per_slot * loss_mask.to(per_slot.dtype), loss_mask, block_size, gamma, sample_from_anchor,
            per_position_loss_weight, dpace_alpha)
        term = reduce_loss(per_slot, loss_mask, weights)
        if len(terms) > 1:
            named[f"{name}_loss"] = term.detach()
        total = total + weight * term
    return total, named


def selector_loss(candidate_scores: torch.Tensor, label_positions: torch.Tensor, loss_mask: torch.Tensor,
                  block_size: int, gamma: float = DEFAULTS["gamma"], sample_from_anchor: bool = False,
                  per_position_loss_weight: str = DEFAULTS["per_position_loss_weight"],
                  dpace_alpha: float = DEFAULTS["dpace_alpha"]) -> torch.Tensor:
    """DFlash2's selector loss: K-way CE of the candidate scores [1, N, k] against the label
    positions [1, N], weighted per slot as the unary loss is and reduced the same way."""
    per_slot = F.cross_entropy(candidate_scores.float().flatten(0, 1), label_positions.flatten(),
                               reduction="none").view(label_positions.shape)
    return reduce_loss(per_slot, loss_mask, slot_weights(per_slot, loss_mask, block_size, gamma, sample_from_anchor,
                                                         per_position_loss_weight, dpace_alpha))


def block_metrics(logits: torch.Tensor, targets: torch.Tensor, loss_mask: torch.Tensor, block_size: int,
                  sample_from_anchor: bool = False) -> dict[str, torch.Tensor]:
    """Per-position accuracy and EAL (expected accepted length incl. the bonus token).

    EAL = mean over blocks of (leading run of correct drafted slots + 1), counted over
    blocks that have at least one trained slot.
    """
    first = first_proposing_slot(sample_from_anchor)
    correct = (logits.argmax(-1) == targets.argmax(-1)).reshape(-1, block_size)[:, first:]
    valid = loss_mask.bool().reshape(-1, block_size)[:, first:]
    hits = (correct & valid).float()
    counts = valid.float().sum(0)
    position_acc = hits.sum(0) / counts.clamp(min=1)
    run = hits.cumprod(dim=1).sum(dim=1) + 1.0
    block_valid = valid.any(dim=1).float()
    eal = (run * block_valid).sum() / block_valid.sum().clamp(min=1)
    return {"position_acc": position_acc, "position_count": counts,
            "accuracy": hits.sum() / counts.sum().clamp(min=1), "eal": eal}

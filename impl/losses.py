"""Per-slot loss weights, loss kinds and speculators' reduction."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def decay_weights(block_size: int, gamma: float = 4.0, sample_from_anchor: bool = False,
                  device: torch.device | None = None) -> torch.Tensor:
    """[B] weights: DFlash w(0) = 0, w(k) = exp(-(k-1)/gamma); sample-from-anchor w(k) = exp(-k/gamma)."""
    k = torch.arange(block_size, dtype=torch.float32, device=device)
    if sample_from_anchor:
        return torch.exp(-k / gamma)
    return torch.exp(-(k - 1).clamp(min=0) / gamma) * (k != 0)


def elementwise_loss(logits: torch.Tensor, targets: torch.Tensor, kind: str = "kl_div") -> torch.Tensor:
    """[1, N] per-slot loss: KL(target || draft) or CE against the target's argmax."""
    if kind == "kl_div":
        log_q = F.log_softmax(logits, dim=-1, dtype=torch.float32)
        p = F.softmax(targets, dim=-1, dtype=torch.float32)
        return F.kl_div(log_q, p, reduction="none").sum(-1)
    if kind == "ce":
        labels = targets.argmax(-1)
        return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), reduction="none").view(labels.shape)
    raise ValueError(f"loss_kind: unknown loss kind {kind!r}; expected 'kl_div' or 'ce'")


def reduce_loss(per_slot: torch.Tensor, loss_mask: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """sum(w * mask * loss) / (sum(mask) + 1e-5) per sequence, then the mean.

    The denominator counts masked slots, not weights (speculators' reduction).
    """
    block_size = weights.numel()
    per_slot_weight = weights.repeat(per_slot.shape[1] // block_size)[None]
    mask = loss_mask.to(per_slot.dtype)
    total = (per_slot * mask * per_slot_weight).sum(dim=1)
    return (total / (mask.sum(dim=1) + 1e-5)).mean()


def dflash_loss(logits: torch.Tensor, targets: torch.Tensor, loss_mask: torch.Tensor, block_size: int,
                gamma: float = 4.0, kind: str = "kl_div", sample_from_anchor: bool = False) -> torch.Tensor:
    weights = decay_weights(block_size, gamma, sample_from_anchor, device=logits.device)
    return reduce_loss(elementwise_loss(logits, targets, kind), loss_mask, weights)


def block_metrics(logits: torch.Tensor, targets: torch.Tensor, loss_mask: torch.Tensor, block_size: int,
                  sample_from_anchor: bool = False) -> dict[str, torch.Tensor]:
    """Per-position accuracy and EAL (expected accepted length incl. the bonus token).

    EAL = mean over blocks of (leading run of correct drafted slots + 1), counted over
    blocks that have at least one trained slot.
    """
    first = 0 if sample_from_anchor else 1
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

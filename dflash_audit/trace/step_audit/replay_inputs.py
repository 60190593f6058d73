"""The target's inputs as the step ran them, for the rerun that gives every candidate (target_values.py): every
target call of the step (its micro-batches) as one batch of rows, each with the attention mask it ran under.

- Calls of one width: their rows stacked, each call's mask beside its rows (a call that passed none: all seen).
- Calls of different widths holding several rows each (micro-batches of right-padded rows): each right-padded to the
  widest, the added columns masked out, so every row runs as the trainer ran it (its padding under its own mask, not
  read as a continuation of the row before it).
- Single rows of different lengths (documents run one by one, or cut from a packed row): one row, end to end, each
  document run alone.
A row's place is its flat index in that batch."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ReplayInputs:
    tokens: torch.Tensor | list[torch.Tensor]  # [rows, width], or the documents run one by one
    attention_mask: torch.Tensor | None
    position_ids: torch.Tensor | None


def paired_mask(name: str, entries: dict) -> str | None:
    """The attention mask the recorder kept beside a token tensor (`<prefix>tokens.<i>`: `<prefix>attention_mask.<i>`)."""
    head, _, index = name.rpartition("tokens.")
    mask = f"{head}attention_mask.{index}"
    return mask if entries.get(mask, {}).get("role") == "target_attention_mask" else None


def replay_inputs(meta: dict, tensors: dict, pad_id: int | None) -> ReplayInputs:
    entries = meta["entries"]
    names = [n for n, e in entries.items() if e["role"] == "tokens"]
    calls = [tensors[n].reshape(-1, tensors[n].shape[-1]) for n in names]
    masks = [tensors[m].reshape(c.shape) if m is not None and tensors[m].numel() == c.numel() and
             tensors[m].dim() <= 2 else None for c, m in zip(calls, (paired_mask(n, entries) for n in names))]
    all_masks = [tensors[n] for n, e in entries.items() if e["role"] == "target_attention_mask"]
    all_positions = [tensors[n] for n, e in entries.items() if e["role"] == "target_position_ids"]
    widths = {c.shape[-1] for c in calls}
    if len(widths) > 1 and all(c.shape[0] == 1 for c in calls):
        return ReplayInputs([c.reshape(-1) for c in calls], None, None)
    positions = all_positions[0] if len(all_positions) == 1 and len(calls) == 1 else None
    if len(calls) == 1:
        mask = all_masks[0] if len(all_masks) == 1 else None
        return ReplayInputs(calls[0], unpadded(mask), positions)
    width = max(widths)
    pad = pad_id if pad_id is not None else 0
    tokens = torch.cat([torch.nn.functional.pad(c, (0, width - c.shape[-1]), value=pad) for c in calls])
    if len(widths) == 1 and all(m is None for m in masks):
        return ReplayInputs(tokens, None, None)
    mask = torch.cat([torch.nn.functional.pad((m if m is not None else torch.ones_like(c)).long(),
                                              (0, width - c.shape[-1]), value=0) for c, m in zip(calls, masks)])
    return ReplayInputs(tokens, unpadded(mask), None)


def unpadded(mask: torch.Tensor | None) -> torch.Tensor | None:
    """No padding anywhere: the plain rerun."""
    return None if mask is not None and bool(mask.dim() == 2 and mask.bool().all()) else mask

"""Which rows of a recorded tensor are evidence. A row the step's recorded masks exclude holds a value nothing the
step computes from reads: comparing it with the target's tensor says nothing of the trainer (a right-padding row may
hold zeros, or the target's state under another mask), so it is left out of every by-value comparison, and said.

The masks read:
- the drafter's attention or key-padding mask (a boolean or integer keyword of its call, recorded as
  `drafter_kwarg`): a context position no query of its batch element sees;
- the target's attention mask: a padding position of its input, for a tensor laid out as that input ([rows, seq]).

A mask's sense: torch's `key_padding_mask` convention (True or nonzero: hidden) for a keyword named *padding*; every
other mask is Hugging Face's and SDPA's (True or nonzero: seen). A mask is laid out batch first, keys last, the keys
the context's positions, or the context's then the block's (z-lab's [context ; block])."""

from __future__ import annotations

import torch


def is_mask_keyword(kwarg: str) -> bool:
    return "mask" in kwarg.lower()


def seen_keys(mask: torch.Tensor, kwarg: str) -> torch.Tensor | None:
    """[elements, keys]: which keys some query of each batch element sees; None for a mask read no other way (an
    additive float mask, a vector)."""
    if mask.is_floating_point() or mask.is_complex() or mask.dim() < 2:
        return None
    seen = (mask == 0) if "padding" in kwarg.lower() else (mask != 0)
    return seen.reshape(seen.shape[0], -1, seen.shape[-1]).any(1)


def context_seen(mask: torch.Tensor, kwarg: str, elements: int, context: int, queries: int) -> torch.Tensor | None:
    """[elements, context]: the context positions the drafter's mask lets each batch element's queries see; None
    where the mask does not lay out as this context (or hides all of it: then it is no mask of this context)."""
    seen = seen_keys(mask, kwarg)
    if seen is None or seen.shape[0] not in (1, elements) or seen.shape[-1] not in (context, context + queries):
        return None
    seen = seen[:, :context].expand(elements, context)
    return seen if bool(seen.any()) else None


def padding_rows(mask: torch.Tensor, shape: list[int]) -> torch.Tensor | None:
    """The target's attention mask over a tensor laid out as its input ([rows, seq, ...]): each of the tensor's
    rows (flattened) that is padding; None where the layouts differ."""
    if mask.is_floating_point() or list(mask.shape) != list(shape[:-1]):
        return None
    return (mask == 0).reshape(-1)

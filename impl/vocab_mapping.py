"""A reduced draft vocabulary: which target tokens the drafter can propose, and the `d2t` map to them.

Conventions are speculators' (`speculators.train.vocab_mapping`, `DraftVocabMixin`) and vLLM's
(`compute_logits` of its DFlash and EAGLE-3 drafters):
- `d2t` [draft_vocab] holds OFFSETS: draft id k proposes target id `k + d2t[k]`;
- `t2d` [target_vocab] is a boolean mask of the target ids the draft vocabulary holds;
- the draft ids cover the selected target ids in increasing order, so `t2d`-selected rows of the
  target's head are the draft head's rows, in draft-id order.
The selection is the most frequent loss-masked tokens of the training data (ties: the smaller
id first), padded with the smallest unused ids when the data holds fewer distinct tokens.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

import torch

from foundation.token_ids import outside_vocabulary

class MappingError(ValueError):
    """A d2t that cannot be a draft vocabulary's map (wrong shape, ids outside the target, repeats)."""


def count_token_frequencies(rows: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> dict[int, int]:
    """How often each token id occurs where the loss mask is set, over (input_ids, loss_mask) rows:
    what speculators' `save_token_frequency_distribution` counts (assistant tokens only)."""
    counts: Counter[int] = Counter()
    for input_ids, loss_mask in rows:
        ids, n = input_ids[loss_mask.to(torch.bool)].unique(return_counts=True)
        counts.update(dict(zip(ids.tolist(), n.tolist())))
    return dict(counts)


def mapping_from_frequencies(token_freq: dict[int, int], draft_vocab_size: int,
                             target_vocab_size: int) -> torch.Tensor:
    """`d2t` of the `draft_vocab_size` most frequent tokens (speculators' selection and padding rule)."""
    if not 0 < draft_vocab_size <= target_vocab_size:
        raise MappingError(f"draft vocabulary of {draft_vocab_size} for a target vocabulary of {target_vocab_size}")
    by_frequency = sorted(token_freq, key=lambda token: (-token_freq[token], token))
    selected = by_frequency[:draft_vocab_size]
    taken = set(selected)
    filler = (token for token in range(target_vocab_size) if token not in taken)
    while len(selected) < draft_vocab_size:
        selected.append(next(filler))
    return d2t_from_target_ids(sorted(selected))


def d2t_from_target_ids(target_ids: list[int] | torch.Tensor) -> torch.Tensor:
    ids = torch.as_tensor(target_ids, dtype=torch.long)
    return ids - torch.arange(ids.numel(), dtype=torch.long)


def target_ids(d2t: torch.Tensor) -> torch.Tensor:
    """The target id each draft id proposes: k + d2t[k]."""
    return torch.arange(d2t.numel(), dtype=torch.long, device=d2t.device) + d2t.long()


def t2d_from_d2t(d2t: torch.Tensor, target_vocab_size: int) -> torch.Tensor:
    t2d = torch.zeros(target_vocab_size, dtype=torch.bool)
    t2d[target_ids(d2t).cpu()] = True
    return t2d


def mapping_problems(d2t: torch.Tensor | None, draft_vocab_size: int, target_vocab_size: int) -> list[str]:
    """Why `d2t` cannot map a draft vocabulary of this size into this target one (empty: it can)."""
    if d2t is None:
        return ["no d2t mapping"]
    if d2t.dim() != 1 or d2t.numel() != draft_vocab_size:
        return [f"d2t has shape {list(d2t.shape)}, the draft vocabulary needs [{draft_vocab_size}]"]
    if d2t.dtype.is_floating_point or d2t.dtype == torch.bool:
        return [f"d2t is {str(d2t.dtype).removeprefix('torch.')}, not integer offsets"]
    ids = target_ids(d2t)
    problems = []
    outside = int(outside_vocabulary(ids, target_vocab_size).sum())
    if outside:
        problems.append(f"{outside} draft id(s) map outside the target vocabulary 0..{target_vocab_size - 1}")
    repeated = ids.numel() - ids.unique().numel()
    if repeated:
        problems.append(f"{repeated} target id(s) are mapped to by more than one draft id")
    return problems


def check_mapping(d2t: torch.Tensor | None, draft_vocab_size: int, target_vocab_size: int, source: str) -> None:
    problems = mapping_problems(d2t, draft_vocab_size, target_vocab_size)
    if problems:
        raise MappingError(f"{source}: {'; '.join(problems)}")


def t2d_problems(t2d: torch.Tensor, d2t: torch.Tensor, target_vocab_size: int) -> list[str]:
    """How a stored t2d disagrees with the t2d its d2t implies (speculators stores both)."""
    if t2d.dim() != 1 or t2d.numel() != target_vocab_size:
        return [f"t2d has shape {list(t2d.shape)}, the target vocabulary needs [{target_vocab_size}]"]
    implied = t2d_from_d2t(d2t, target_vocab_size)
    differ = int((t2d.bool().cpu() != implied).sum())
    return [f"t2d marks {differ} target id(s) differently from d2t"] if differ else []


def differing_ids(d2t_a: torch.Tensor, d2t_b: torch.Tensor) -> tuple[int, int]:
    """(target ids only a proposes, target ids only b proposes)."""
    a, b = set(target_ids(d2t_a).tolist()), set(target_ids(d2t_b).tolist())
    return len(a - b), len(b - a)

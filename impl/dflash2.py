"""The two pieces DFlash2 adds to a DFlash drafter: local convolutions and a candidate selector.

Grouped dynamic causal convolution. Around each layer's attention and MLP, a K-tap
convolution along the block mixes each slot with the K-1 slots before it. Channels come in
groups of `group_size`; each tap's coefficient is a learned base kernel (per channel) plus a
dynamic delta (per group) projected from the sublayer's input. One projection gives both
deltas: the input side's (`prepare`) and the output side's (`finish`). Taps never reach
across a block boundary, so a block sees nothing of the block before it.

Candidate selector. The drafter's unary logits propose their top-k per slot; the selector
reranks them with a rank-r bilinear term that couples a slot's hidden state, its
predecessor token and each candidate:
    score(c) = unary(c) + <predecessor_code[prev] * hidden_projection(h), successor_code[c]>
At inference the path is chosen slot by slot (the chosen token is the next slot's
predecessor, the block's first token the first one's); in training the predecessors are the
true tokens (teacher forcing) and the loss is a K-way cross-entropy over the candidates.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


def grouped_dynamic_conv(x: torch.Tensor, delta: torch.Tensor, base: torch.Tensor, group_size: int,
                         block_size: int) -> torch.Tensor:
    """Causal K-tap convolution of `x` [b, n, H] along n, restarted every `block_size` slots.

    delta [b, n, K, G]: per-slot, per-group dynamic coefficients; base [K, H]: per-channel ones.
    Tap t of slot i reads slot i - t, when that slot lies in the same block.
    """
    batch, length, hidden = x.shape
    taps, groups = base.shape[0], hidden // group_size
    grouped = x.view(batch, length, groups, group_size)
    slot = torch.arange(length, device=x.device) % block_size
    out = torch.zeros_like(grouped)
    for tap in range(taps):
        shifted = grouped if tap == 0 else F.pad(grouped[:, : length - tap], (0, 0, 0, 0, tap, 0))
        shifted = shifted * (slot >= tap).view(1, length, 1, 1)
        # base·x, then + delta·x: two roundings, in z-lab's order (one (base + delta)·x rounds
        # differently below float32, and a bfloat16 drafter would then not draft z-lab's tokens).
        out = out + base[tap].to(x.dtype).view(1, 1, groups, group_size) * shifted
        out = torch.addcmul(out, delta[:, :, tap, :, None], shifted)
    return out.view_as(x)


class GroupedDynamicCausalConv(nn.Module):
    """The input-side and output-side convolutions of one sublayer (attention or MLP)."""

    def __init__(self, hidden_size: int, kernel_size: int, group_size: int, block_size: int):
        super().__init__()
        self.kernel_size, self.group_size, self.block_size = kernel_size, group_size, block_size
        self.groups = hidden_size // group_size
        self.base_kernel = nn.Parameter(torch.empty(2, kernel_size, hidden_size))  # [input/output side, K, H]
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * self.groups, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Identity convolutions: an untrained DFlash2 layer computes what a DFlash layer does."""
        with torch.no_grad():
            self.base_kernel.zero_()
            self.base_kernel[:, 0] = 1.0
            self.kernel_projection.weight.zero_()

    def prepare(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The convolved sublayer input, and the output side's delta [b, n, K, G] for `finish`."""
        deltas = self.kernel_projection(x).view(*x.shape[:-1], 2, self.kernel_size, self.groups)
        convolved = grouped_dynamic_conv(x, deltas[..., 0, :, :], self.base_kernel[0], self.group_size,
                                         self.block_size)
        return convolved, deltas[..., 1, :, :]

    def finish(self, y: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        return grouped_dynamic_conv(y, delta, self.base_kernel[1], self.group_size, self.block_size)


@dataclass
class SelectedPath:
    tokens: torch.Tensor  # [b, n] the chosen token of each slot
    candidates: torch.Tensor  # [b, n, k] the unary top-k, in `torch.topk(sorted=False)` order
    probs: torch.Tensor | None  # [b, n, k] sampling distribution over the candidates (None when greedy)


class CandidateSelector(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, rank: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        # Parameters, not Embeddings: the checkpoint names carry no `.weight` (both references' files).
        self.predecessor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.successor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)
        self.reset_parameters()

    def reset_parameters(self, std: float = 0.02) -> None:
        for weight in (self.predecessor_codebook, self.successor_codebook, self.hidden_projection.weight):
            nn.init.normal_(weight, std=std)

    def transition_scores(self, hidden: torch.Tensor, predecessor_ids: torch.Tensor,
                          candidate_ids: torch.Tensor) -> torch.Tensor:
        """[..., k] bilinear term of each candidate; hidden [..., H], predecessors [...], candidates [..., k]."""
        context = self.predecessor_codebook[predecessor_ids.long()] * self.hidden_projection(hidden)
        return torch.einsum("...r,...kr->...k", context, self.successor_codebook[candidate_ids.long()])

    def score_candidates(self, unary_logits: torch.Tensor, hidden: torch.Tensor, predecessor_ids: torch.Tensor,
                         candidate_ids: torch.Tensor) -> torch.Tensor:
        """[..., k] unary logit of each candidate plus its transition score."""
        return unary_logits.gather(-1, candidate_ids) + self.transition_scores(hidden, predecessor_ids, candidate_ids)

    def select(self, hidden: torch.Tensor, unary_logits: torch.Tensor, first_predecessor: torch.Tensor,
               pick) -> SelectedPath:
        """The path through one block's slots [b, n]: each slot's pick becomes the next slot's predecessor.

        `pick(scores [b, k])` returns (index [b], probs [b, k] or None): argmax, or a draw at a temperature.
        """
        _, candidates = torch.topk(unary_logits, self.top_k, dim=-1, sorted=False)
        projected = self.hidden_projection(hidden)
        predecessor, path, rows = first_predecessor, [], []
        for slot in range(hidden.shape[1]):
            candidate_slot = candidates[:, slot]
            scores = unary_logits[:, slot].gather(-1, candidate_slot) + torch.einsum(
                "br,bkr->bk", self.predecessor_codebook[predecessor] * projected[:, slot],
                self.successor_codebook[candidate_slot])
            index, probs = pick(scores)
            if probs is not None:
                rows.append(probs)
            predecessor = candidate_slot.gather(-1, index[:, None])[:, 0]
            path.append(predecessor)
        return SelectedPath(torch.stack(path, dim=1), candidates, torch.stack(rows, dim=1) if rows else None)


def training_candidates(candidate_ids: torch.Tensor, target_ids: torch.Tensor):
    """The selector's K-way training problem from the unary top-k [..., k] (best first) and hard targets [...].

    When the target is not among the candidates it replaces the weakest (the last), so every
    slot has a label. Returns (candidates [..., k], label position [...], target was in the top-k [...]).
    """
    matches = candidate_ids == target_ids[..., None]
    contains = matches.any(-1)
    positions = torch.where(contains, matches.long().argmax(-1), candidate_ids.shape[-1] - 1)
    candidates = candidate_ids.clone()
    candidates[..., -1] = torch.where(contains, candidates[..., -1], target_ids)
    return candidates, positions, contains


def teacher_forced_predecessors(block_tokens: torch.Tensor, sample_from_anchor: bool = False) -> torch.Tensor:
    """[A, B] true tokens of each block -> each slot's predecessor: the token before it (slot 0: the anchor).

    With `sample_from_anchor` a slot's own position already holds the token it follows."""
    if sample_from_anchor:
        return block_tokens
    return torch.cat([block_tokens[:, :1], block_tokens[:, :-1]], dim=1)


@dataclass
class SelectorTraining:
    """The selector's teacher-forced training problem over all slots [b, N = A*B]."""

    predecessors: torch.Tensor  # [b, N] true token before each slot
    candidates: torch.Tensor  # [b, N, k] unary top-k with a missing target swapped in last
    label_positions: torch.Tensor  # [b, N] where the target sits among the candidates
    contains_target: torch.Tensor  # [b, N] the target was in the unary top-k itself
    scores: torch.Tensor  # [b, N, k] selector scores of the candidates (differentiable)


def selector_training(selector: CandidateSelector, hidden: torch.Tensor, unary_logits: torch.Tensor,
                      targets: torch.Tensor, predecessors: torch.Tensor) -> SelectorTraining:
    """Candidates, labels and scores for one training forward: hidden [b, N, H], logits/targets [b, N, V]."""
    top = unary_logits.topk(selector.top_k, dim=-1).indices
    candidates, positions, contains = training_candidates(top, targets.argmax(-1))
    scores = selector.score_candidates(unary_logits, hidden, predecessors, candidates)
    return SelectorTraining(predecessors, candidates, positions, contains, scores)

"""What DSpark's and XPress's heads add to a training forward (speculators' `DSparkDraftModel.forward`,
`XPressDraftModel.forward`), on blocks of true tokens (teacher forcing).

DSpark: the Markov bias of each slot's previous true token is added to the logits; the confidence head reads the
slot's hidden state (and that token's Markov embedding). XPress: the refiner's bias over the previous true tokens
gives the teacher-forced refined logits; `consistency_passes` free-running rounds re-feed it the previous round's
argmax (the first round the backbone's), no gradient through the picks; the backbone's own logits are kept for
the anchor term. Slot k's previous token: impl/dspark.py and impl/xpress.py.
"""

from __future__ import annotations

import torch

from impl.dflash2 import teacher_forced_predecessors
from impl.dspark import confidence_features
from impl.family_losses import FamilyTraining
from impl.recipe import Recipe
from impl.xpress import previous_tokens


def token_before_anchor(input_ids: torch.Tensor, document_ids: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
    """[A] the token before each anchor in its own document; the anchor itself at a document's start (XPress)."""
    before = (anchors - 1).clamp(min=0)
    same_document = (anchors > 0) & (document_ids[before] == document_ids[anchors])
    return torch.where(same_document, input_ids[before], input_ids[anchors])


def data_labels(input_ids: torch.Tensor, slots: torch.Tensor, sample_from_anchor: bool) -> torch.Tensor:
    """[A*B] the data token each slot proposes: the one after it (sample-from-anchor) or its own."""
    if sample_from_anchor:
        return input_ids[(slots + 1).clamp(max=input_ids.shape[0] - 1)]
    return input_ids[slots]


def dspark_heads(drafter, hidden: torch.Tensor, logits: torch.Tensor, block_tokens: torch.Tensor,
                 sample_from_anchor: bool) -> tuple[torch.Tensor, FamilyTraining]:
    """(Markov-corrected logits [b, A*B, V], the confidence logits [b, A*B] or None)."""
    block = block_tokens.shape[1]
    prev = teacher_forced_predecessors(block_tokens, sample_from_anchor)
    hidden_blocks = hidden.reshape(-1, block, hidden.shape[-1])
    if drafter.markov_head is not None:
        bias = drafter.markov_head.block_bias(prev, hidden_blocks)
        logits = (logits.reshape(-1, block, logits.shape[-1]) + bias).reshape(logits.shape)
    confidence = None
    if drafter.confidence_head is not None:
        embedded = drafter.markov_head.embed(prev) if drafter.spec.confidence_head_with_markov else None
        confidence = drafter.confidence_head(confidence_features(hidden_blocks, embedded)).reshape(logits.shape[:2])
    return logits, FamilyTraining(confidence_logits=confidence)


def xpress_heads(drafter, hidden: torch.Tensor, logits: torch.Tensor, block_tokens: torch.Tensor,
                 before_anchor: torch.Tensor, labels: torch.Tensor, recipe: Recipe,
                 sample_from_anchor: bool) -> tuple[torch.Tensor, FamilyTraining]:
    """(teacher-forced refined logits [b, A*B, V], the rounds' and the backbone's logits, the data labels)."""
    head, block = drafter.refiner_head, block_tokens.shape[1]
    hcache = head.hidden_cache(hidden.reshape(-1, block, hidden.shape[-1]))
    base = logits.reshape(-1, block, logits.shape[-1])
    refined = base + head.block_bias(previous_tokens(block_tokens, before_anchor, sample_from_anchor), hcache)
    rounds = []
    if recipe.consistency_weight > 0 and recipe.consistency_passes > 0:
        anchor, pick = block_tokens[:, :1], base.detach().argmax(-1)
        for _ in range(recipe.consistency_passes):
            if sample_from_anchor:  # slot k follows p + k: the anchor, then the picks
                prev = torch.cat([anchor, pick[:, :-1]], dim=1)
            else:  # slot 0 is the anchor, not a pick; slot k follows slot k - 1
                pick[:, :1] = anchor
                prev = torch.cat([before_anchor[:, None], pick[:, :-1]], dim=1)
            round_logits = base + head.block_bias(prev, hcache)
            rounds.append(round_logits.reshape(logits.shape))
            pick = round_logits.detach().argmax(-1)
    return refined.reshape(logits.shape), FamilyTraining(
        round_logits=rounds, base_logits=logits if recipe.base_anchor_weight > 0 else None, data_labels=labels)

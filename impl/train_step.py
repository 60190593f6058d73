"""One DFlash training forward: target states -> anchors -> targets -> drafter -> loss (DSpark's and XPress's heads
and losses after the drafter: impl/family_step.py, impl/family_losses.py).

The single code path shared by the trainer and the conformance suite (through
`OursImplementation.training_outputs`). Every piece is impl's building block:
`HiddenStateExtractor` (one no-grad target forward), `anchors.select_anchors`,
`TargetAligner` (targets from the verifier source layer's raw output through the final
norm and LM head once), `DFlashDrafter` with `training_masks`, `losses.dflash_loss` and
`losses.block_metrics`. Rows of a batch are independent packed sequences.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from impl import anchors as anchor_rules
from impl import losses
from impl.anchors import anchor_blocks
from impl.dflash2 import selector_training, teacher_forced_predecessors
from impl.extract import HiddenStateExtractor, final_norm, output_head
from impl.family_losses import FamilyTraining, dspark_loss, xpress_loss
from impl.family_step import data_labels, dspark_heads, token_before_anchor, xpress_heads
from impl.interface import TrainingOutputs
from impl.model import DFlashDrafter
from impl.recipe import Recipe
from impl.spec import SpecError
from impl.target_alignment import TargetAligner


@dataclass
class StepOutputs:
    outputs: TrainingOutputs  # all rows: logits/targets/loss_mask [b, A*B, ...], anchors [b, A]
    loss: torch.Tensor | None
    metrics: dict[str, torch.Tensor] | None
    clean_context: torch.Tensor  # [b, T, F] the target's context features
    drafter_context: torch.Tensor  # [b, T, F] what fed fc (clean + noise)
    terms: dict[str, torch.Tensor] | None = None  # DSpark, XPress: every loss term, in speculators' metric names


def trained_layout(drafter: DFlashDrafter, recipe: Recipe) -> bool:
    """The slot layout a step trains: the drafter's own. A recipe that says otherwise is refused, so a
    checkpoint's recipe never records a layout its drafter does not have."""
    layout = drafter.spec.sample_from_anchor
    if recipe.sample_from_anchor != layout:
        raise SpecError("sample_from_anchor", f"the recipe says {recipe.sample_from_anchor}, the drafter's slot "
                                              f"layout is {layout}: training follows the drafter's layout")
    return layout


def training_step(drafter: DFlashDrafter, target: nn.Module, input_ids: torch.Tensor, loss_mask: torch.Tensor,
                  document_ids: torch.Tensor, recipe: Recipe, *, position_ids: torch.Tensor | None = None,
                  generators: Sequence[torch.Generator] | None = None,
                  forward: Callable[..., torch.Tensor] | None = None, with_loss: bool = True,
                  anchors: Sequence[tuple[torch.Tensor, torch.Tensor]] | None = None) -> StepOutputs:
    """Loss and outputs of one step on packed rows [b, T].

    `generators`: one per row for anchors and noise (reproducible under resume and across
    ranks); None draws from torch's global RNG. `forward`: the drafter's forward as called
    (a DDP wrapper), defaults to `drafter` itself. `anchors`: one `(positions, valid)` per row used
    instead of a draw (the conformance suite feeds the reference's own).
    """
    forward = forward or drafter
    rows, length = input_ids.shape
    block = drafter.block_size
    if position_ids is None:
        position_ids = torch.arange(length, device=input_ids.device).expand(rows, -1)
    generators = list(generators) if generators is not None else [None] * rows

    # Restarting position ids also make transformers mask attention per packed document.
    states = HiddenStateExtractor(target, drafter.target_layer_ids, recipe.verifier_source_layer)(
        input_ids, position_ids=position_ids)
    layout = trained_layout(drafter, recipe)
    aligner = TargetAligner(block, layout)
    norm, head = final_norm(target), output_head(target)
    verifier_head = drafter.verifier_head(head)  # a reduced draft vocabulary's rows of it (speculators)

    forced = anchors
    anchors, valid, targets, slot_mask, slot_ids, slot_pos, contexts, attn = [], [], [], [], [], [], [], []
    predecessors, blocks, before, labels = [], [], [], []
    for row in range(rows):
        if forced is not None:
            row_anchors, row_valid = (t.to(input_ids.device) for t in forced[row])
        else:
            row_anchors, row_valid = anchor_rules.select_anchors(loss_mask[row: row + 1], recipe.max_anchors, block,
                                                                 generator=generators[row])
        anchors.append(row_anchors)
        valid.append(row_valid)
        # Targets from clean verifier states only: noise below never reaches them.
        targets.append(aligner.target_logits(states.source[row: row + 1], norm, verifier_head, row_anchors))
        slot_mask.append(aligner.loss_mask(loss_mask[row: row + 1], row_anchors, row_valid))
        slot_ids.append(anchor_blocks(input_ids[row, row_anchors], block, drafter.mask_token_id).reshape(-1))
        slot_pos.append(anchor_rules.block_indices(position_ids[row, row_anchors], block))
        block_tokens = input_ids[row, anchor_rules.block_indices(row_anchors, block)].view(-1, block)
        predecessors.append(teacher_forced_predecessors(block_tokens, layout).reshape(-1))
        blocks.append(block_tokens)
        before.append(token_before_anchor(input_ids[row], document_ids[row], row_anchors))
        labels.append(data_labels(input_ids[row], anchor_rules.block_indices(row_anchors, block), layout))
        context = states.context[row]
        if recipe.noise_std > 0:
            noise = torch.randn(context.shape, generator=generators[row], dtype=context.dtype, device=context.device)
            context = context + recipe.noise_std * noise
        contexts.append(context)
        attn.append(drafter.training_masks(document_ids[row: row + 1], row_anchors))

    masks = [torch.stack([row_masks[layer] for row_masks in attn])[:, None] for layer in range(len(attn[0]))]
    drafter_context = torch.stack(contexts)
    positions = torch.cat([position_ids, torch.stack(slot_pos)], dim=1)
    hidden = forward(drafter.embed(target, torch.stack(slot_ids)), drafter_context, positions, masks=masks)
    logits = drafter.draft_logits(hidden, head)  # over the head's own vocabulary, as the targets
    family = None
    if drafter.spec.family == "dspark":  # the logits trained (and proposed from) are the Markov-corrected ones
        logits, family = dspark_heads(drafter, hidden, logits, torch.cat(blocks), layout)
    elif drafter.spec.family == "xpress":  # ... the teacher-forced refined ones
        logits, family = xpress_heads(drafter, hidden, logits, torch.cat(blocks), torch.cat(before),
                                      torch.stack(labels), recipe, layout)
    outputs = TrainingOutputs(anchors=torch.stack(anchors), anchor_valid=torch.stack(valid), logits=logits,
                              targets=torch.cat(targets), loss_mask=torch.cat(slot_mask), hidden=hidden,
                              family=family)
    if drafter.candidate_selector is not None:  # DFlash2: the selector trains on teacher-forced predecessors
        outputs.selector = selector_training(drafter.candidate_selector, hidden, logits, outputs.targets,
                                             torch.stack(predecessors))
    loss = metrics = terms = None
    if with_loss and family is not None:
        terms = family_loss(outputs, family, block, recipe, layout, drafter.spec.family)
        loss = terms["loss"]
    elif with_loss:
        loss = losses.dflash_loss(logits, outputs.targets, outputs.loss_mask, block, recipe.gamma, recipe.loss_fn,
                                  layout, recipe.per_position_loss_weight, recipe.dpace_alpha)
        if outputs.selector is not None:
            loss = loss + recipe.selector_loss_alpha * losses.selector_loss(
                outputs.selector.scores, outputs.selector.label_positions, outputs.loss_mask, block, recipe.gamma,
                layout, recipe.per_position_loss_weight, recipe.dpace_alpha)
    if with_loss:
        with torch.no_grad():
            metrics = losses.block_metrics(logits, outputs.targets, outputs.loss_mask, block, layout)
    return StepOutputs(outputs, loss, metrics, states.context, drafter_context, terms)


def family_loss(outputs: TrainingOutputs, family: FamilyTraining, block: int, recipe: Recipe, layout: bool,
                name: str) -> dict[str, torch.Tensor]:
    """Every loss term of a DSpark or XPress step (impl/family_losses.py), the total under "loss"."""
    if name == "dspark":
        return dspark_loss(outputs.logits, outputs.targets, family.confidence_logits, outputs.loss_mask, block,
                           recipe, layout)
    return xpress_loss(outputs.logits, family, outputs.targets, outputs.loss_mask, block, recipe, layout)

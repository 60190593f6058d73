"""Train a DFlash draft model the way it decodes: one z-lab drafter call per anchor.

Setup: `dflash.model.DFlashDraftModel` (Qwen3 config with `dflash_config`) called exactly as at inference time,
`target_hidden=ctx[:, :anchor]`, `position_ids=arange(anchor + block_size)`, once per anchor.
Batch layout: [batch, seq_len] rows sharing the step's anchors, drawn uniformly at random (seeded) from all but the
last block_size positions. The target's hidden states and greedy labels (argmax of its logits) are made once per
step before the anchor loop; each anchor's loss is a decayed CE, averaged over the anchors of the step.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

import torch
from dflash.model import DFlashDraftModel, extract_context_feature
from torch import nn
from transformers import Qwen3Config, Qwen3ForCausalLM

KNOWN_BUGS = ["fc_4_of_5", "targets_layer_9", "gamma_7", "target_noise_0.5"]


@dataclass
class Recipe:
    target_layer_ids: list[int] = field(default_factory=lambda: [1, 3, 5, 7, 9])
    block_size: int = 4
    num_draft_layers: int = 1
    mask_token_id: int = 3
    seq_len: int = 80
    batch_size: int = 4
    anchors_per_step: int = 16
    decay_gamma: float = 4.0
    target_noise_std: float = 0.0
    lr: float = 3e-3
    seed: int = 0
    # set only by the planted bugs
    fc_layers: int = 5
    label_layer: int | None = None  # None: the last decoder layer


def recipe_with(bugs: list[str]) -> Recipe:
    recipe = Recipe()
    if "fc_4_of_5" in bugs:
        recipe.fc_layers = 4
    if "targets_layer_9" in bugs:
        recipe.label_layer = 9
    if "gamma_7" in bugs:
        recipe.decay_gamma = 7.0
    if "target_noise_0.5" in bugs:
        recipe.target_noise_std = 0.5
    return recipe


def make_drafter(target_path: str, recipe: Recipe) -> DFlashDraftModel:
    config = Qwen3Config.from_pretrained(target_path)
    config.num_target_layers = config.num_hidden_layers
    config.num_hidden_layers = recipe.num_draft_layers
    config.layer_types = ["full_attention"] * recipe.num_draft_layers
    config.dflash_config = {
        "target_layer_ids": recipe.target_layer_ids[: recipe.fc_layers],
        "block_size": recipe.block_size,
        "mask_token_id": recipe.mask_token_id,
    }
    torch.manual_seed(recipe.seed)
    return DFlashDraftModel(config)


class TargetSide:
    """The frozen target: context features for the drafter and the greedy labels it trains toward."""

    def __init__(self, model: Qwen3ForCausalLM, recipe: Recipe):
        self.model, self.recipe = model, recipe
        self.noise = torch.Generator().manual_seed(recipe.seed + 17)

    @torch.no_grad()
    def __call__(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.model(input_ids, output_hidden_states=True)
        features = extract_context_feature(out.hidden_states, self.recipe.target_layer_ids)
        hidden = self.model.config.hidden_size
        ctx = features[..., : self.recipe.fc_layers * hidden]
        if self.recipe.label_layer is None:
            logits = out.logits
        else:
            layer_out = out.hidden_states[self.recipe.label_layer + 1]
            logits = self.model.lm_head(self.model.model.norm(layer_out))
        if self.recipe.target_noise_std:
            logits = logits + self.recipe.target_noise_std * torch.randn(logits.shape, generator=self.noise)
        return ctx, logits.argmax(-1)


def decay(recipe: Recipe) -> torch.Tensor:
    k = torch.arange(recipe.block_size, dtype=torch.float32)
    w = torch.exp(-(k - 1).clamp(min=0) / recipe.decay_gamma)
    w[0] = 0.0
    return w


def anchor_loss(drafter, target_model, input_ids, ctx, labels, anchor, recipe: Recipe, ce: nn.CrossEntropyLoss):
    B = recipe.block_size
    block = torch.full((input_ids.shape[0], B), recipe.mask_token_id, dtype=torch.long)
    block[:, 0] = input_ids[:, anchor]
    draft = drafter(
        target_hidden=ctx[:, :anchor],
        noise_embedding=target_model.get_input_embeddings()(block),
        position_ids=torch.arange(anchor + B).unsqueeze(0),
    )
    logits = drafter.compute_logits(draft, target_model.lm_head)  # [batch, B, V]
    # block slot k sits at anchor + k; the target predicted it at anchor + k - 1
    slot_labels = torch.cat([labels[:, anchor : anchor + 1], labels[:, anchor : anchor + B - 1]], dim=1)
    per_slot = ce(logits.flatten(0, 1), slot_labels.flatten()).view(-1, B)  # slot 0's label is a placeholder
    mask = torch.ones_like(per_slot)
    mask[:, 0] = 0
    return ((decay(recipe) * mask * per_slot).sum(1) / (mask.sum(1) + 1e-5)).mean()


def train(target_path: str, bugs: list[str], steps: int) -> list[float]:
    recipe = recipe_with(bugs)
    target_model = Qwen3ForCausalLM.from_pretrained(target_path, dtype=torch.float32)
    target_model.eval()
    for p in target_model.parameters():
        p.requires_grad = False
    target_side = TargetSide(target_model, recipe)
    drafter = make_drafter(target_path, recipe)
    drafter.train()
    optimizer = torch.optim.Adam(drafter.parameters(), lr=recipe.lr)
    ce = nn.CrossEntropyLoss(reduction="none")

    rng = torch.Generator().manual_seed(recipe.seed)
    vocab = target_model.config.vocab_size
    losses = []
    for step in range(steps):
        input_ids = torch.randint(0, vocab, (recipe.batch_size, recipe.seq_len), generator=rng)
        anchors = torch.randint(0, recipe.seq_len - recipe.block_size, (recipe.anchors_per_step,), generator=rng)
        ctx, labels = target_side(input_ids)

        optimizer.zero_grad()
        total = 0.0
        for anchor in anchors.tolist():
            loss = anchor_loss(drafter, target_model, input_ids, ctx, labels, anchor, recipe, ce)
            (loss / len(anchors)).backward()
            total += loss.item() / len(anchors)
        optimizer.step()
        losses.append(total)
        print(f"[step {step + 1}/{steps}] ce_loss={total:.4f}")
    return losses


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--target", required=True, help="Qwen3 target folder")
    parser.add_argument("--bug", action="append", default=[], choices=KNOWN_BUGS)
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args()
    train(args.target, args.bug, args.steps)

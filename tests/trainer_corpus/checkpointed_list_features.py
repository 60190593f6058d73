"""DFlash drafter trainer: z-lab's DFlashDraftModel with every decoder layer under activation checkpointing.

Setup: `CheckpointedDrafter` wraps `dflash.model.DFlashDraftModel` (3 layers, block 7, mask id vocab-1) and runs its
forward itself: the context features arrive as a Python list of five [rows, T, H] tensors and are concatenated
inside the wrapper's forward, then z-lab's `fc` / `hidden_norm`, and each decoder layer runs under
`torch.utils.checkpoint.checkpoint(use_reentrant=False)`. All blocks of a row batch are drafted in one call
(blocks flattened to [rows, anchors*B], additive float mask: context before the anchor, the own block, positions
[0..T-1 ; a..a+B-1]). Targets: the base model's `last_hidden_state` (after the final norm) through `lm_head`, one
anchor at a time (only the B-1 positions a..a+B-2 a block trains on); the loss is the decayed KL.
"""

from __future__ import annotations

import argparse
import copy
import math

import torch
import torch.nn.functional as F
from dflash.model import DFlashDraftModel, build_target_layer_ids
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers import AutoConfig, Qwen3ForCausalLM

BUGS = ("fc_4_of_5", "targets_layer_9", "gamma_7", "target_noise_0.5")

DRAFT_LAYERS = 3
FEATURE_LAYERS = 5  # z-lab's rule picks this many target layers
BLOCK = 7
ROWS = 2
SEQ_LEN = 80
ANCHORS_PER_ROW = 6
LR = 5e-4


class CheckpointedDrafter(nn.Module):
    def __init__(self, inner: DFlashDraftModel):
        super().__init__()
        self.inner = inner

    def forward(self, feature_list, noise_embedding, position_ids, attention_mask):
        target_hidden = torch.cat(list(feature_list), dim=-1)
        ctx = self.inner.hidden_norm(self.inner.fc(target_hidden))
        rope = self.inner.rotary_emb(noise_embedding, position_ids)
        hidden = noise_embedding
        for layer in self.inner.layers:
            hidden = checkpoint(
                layer, use_reentrant=False, hidden_states=hidden, target_hidden=ctx,
                attention_mask=attention_mask, position_ids=position_ids, position_embeddings=rope,
            )
        return self.inner.norm(hidden)


def build(target_dir: str, bugs: set[str]) -> tuple[CheckpointedDrafter, list[int]]:
    tcfg = AutoConfig.from_pretrained(target_dir)
    layer_ids = build_target_layer_ids(tcfg.num_hidden_layers, FEATURE_LAYERS)
    if "fc_4_of_5" in bugs:
        layer_ids = layer_ids[:-1]
    cfg = copy.deepcopy(tcfg)
    cfg.num_target_layers = tcfg.num_hidden_layers
    cfg.num_hidden_layers = DRAFT_LAYERS
    cfg.layer_types = ["full_attention"] * DRAFT_LAYERS
    cfg.dflash_config = {"target_layer_ids": layer_ids, "block_size": BLOCK, "mask_token_id": tcfg.vocab_size - 1}
    torch.manual_seed(0)
    return CheckpointedDrafter(DFlashDraftModel(cfg)), layer_ids


@torch.no_grad()
def target_features(target, input_ids, layer_ids):
    """The captured layers as a list of [rows, T, H] tensors, and the base model's output for the targets."""
    out = target.model(input_ids=input_ids, output_hidden_states=True)
    return [out.hidden_states[i + 1] for i in layer_ids], out


@torch.no_grad()
def anchor_targets(target, base_out, anchors, bugs, noise_gen):
    """[rows, n, B, V] teacher logits: slot k of the block at a takes the target's logits at a+k-1 (slot 0 unused),
    one anchor at a time through the LM head."""
    final = target.model.norm(base_out.hidden_states[9 + 1]) if "targets_layer_9" in bugs else base_out.last_hidden_state
    rows, n = anchors.shape
    vocab = target.lm_head.out_features
    out = torch.zeros(rows, n, BLOCK, vocab)
    for r in range(rows):
        for j in range(n):
            a = int(anchors[r, j])
            logits = target.lm_head(final[r, a : a + BLOCK - 1])  # positions a .. a+B-2
            if "target_noise_0.5" in bugs:
                logits = logits + 0.5 * torch.randn(logits.shape, generator=noise_gen)
            out[r, j, 1:] = logits
    return out


def additive_mask(anchors, seq_len):
    """[rows, 1, n*B, T + n*B] of 0 / -inf: context before the block's anchor, and the block itself."""
    rows, n = anchors.shape
    q_anchor = anchors.repeat_interleave(BLOCK, dim=1)
    ctx = torch.arange(seq_len)[None, None] < q_anchor[..., None]
    q_block = torch.arange(n * BLOCK) // BLOCK
    own = (q_block[:, None] == q_block[None, :]).expand(rows, -1, -1)
    allowed = torch.cat([ctx, own], dim=-1)
    return torch.zeros(allowed.shape).masked_fill(~allowed, float("-inf"))[:, None]


def block_loss(draft_logits, teacher, gamma):
    """draft/teacher [rows, n, B, V]; decayed KL, per row over its trained slots, then the mean over rows."""
    k = torch.arange(BLOCK, dtype=torch.float32)
    weight = torch.where(k > 0, torch.exp(-(k - 1) / gamma), torch.zeros(()))
    trained = (k > 0).float()
    kl = (F.softmax(teacher, -1) * (F.log_softmax(teacher, -1) - F.log_softmax(draft_logits, -1))).sum(-1)
    n = draft_logits.shape[1]
    per_row = (weight * trained * kl).sum((1, 2)) / (n * trained.sum() + 1e-5)
    return per_row.mean()


def train_step(drafter, target, layer_ids, input_ids, anchors, bugs, noise_gen):
    rows, seq_len = input_ids.shape
    n = anchors.shape[1]
    feature_list, base_out = target_features(target, input_ids, layer_ids)
    teacher = anchor_targets(target, base_out, anchors, bugs, noise_gen)

    block_ids = torch.full((rows, n, BLOCK), drafter.inner.mask_token_id, dtype=torch.long)
    block_ids[..., 0] = input_ids.gather(1, anchors)
    noise_embedding = target.model.embed_tokens(block_ids.flatten(1))
    block_pos = (anchors[..., None] + torch.arange(BLOCK)).flatten(1)
    position_ids = torch.cat([torch.arange(seq_len).expand(rows, -1), block_pos], dim=1)

    hidden = drafter(feature_list, noise_embedding, position_ids, additive_mask(anchors, seq_len))
    draft_logits = drafter.inner.compute_logits(hidden, target.lm_head).view(rows, n, BLOCK, -1)
    gamma = 7.0 if "gamma_7" in bugs else 4.0
    return block_loss(draft_logits, teacher, gamma)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", required=True)
    ap.add_argument("--bug", action="append", default=[], choices=BUGS)
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args(argv)
    bugs = set(args.bug)

    torch.manual_seed(0)
    target = Qwen3ForCausalLM.from_pretrained(args.target, dtype=torch.float32).eval().requires_grad_(False)
    drafter, layer_ids = build(args.target, bugs)
    drafter.train()
    opt = torch.optim.AdamW(drafter.parameters(), lr=LR, weight_decay=0.01)

    data_gen = torch.Generator().manual_seed(21)
    noise_gen = torch.Generator().manual_seed(22)
    for step in range(args.steps):
        input_ids = torch.randint(target.config.vocab_size - 1, (ROWS, SEQ_LEN), generator=data_gen)
        anchors = torch.stack([torch.randperm(SEQ_LEN - BLOCK, generator=data_gen)[:ANCHORS_PER_ROW].sort().values
                               for _ in range(ROWS)])
        loss = train_step(drafter, target, layer_ids, input_ids, anchors, bugs, noise_gen)
        opt.zero_grad()
        loss.backward()
        opt.step()
        assert math.isfinite(loss.item())
        print(f"step {step} loss {loss.item():.4f}", flush=True)


if __name__ == "__main__":
    main()

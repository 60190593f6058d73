"""DFlash trainer: blocks laid out [n_blocks, batch, B] and gathered by index; targets made in a loss module from hooks.

Setup: z-lab's `DFlashDraftModel` (2 layers, block 4, mask id vocab-1). Each row draws its own sorted anchors; the
block token ids, their positions and the teacher rows are gathered by index into a block-major layout
[n_blocks, batch, B]. The drafter is called once per block index j over the whole batch: context = the row's full
features with a 4-D boolean mask (context positions before that row's anchor, and the own block), positions
[0..S-1 ; a..a+B-1]. A separate `HookedTeacherLoss` module registers forward hooks on the target's decoder layers:
it hands the drafter its context features and builds the targets itself from the last layer's raw output through
the target's final norm and head; the loss is a decayed KL over [n_blocks, batch, B].
"""

from __future__ import annotations

import argparse
import copy

import torch
import torch.nn.functional as F
from dflash.model import DFlashDraftModel
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM

BUGS = ("fc_4_of_5", "targets_layer_9", "gamma_7", "target_noise_0.5")
CAPTURE = (1, 3, 5, 7, 9)
BLOCK, N_BLOCKS, ROWS, SEQ = 4, 5, 3, 64


class HookedTeacherLoss(nn.Module):
    """Owns the hooks on the target; gives the drafter its features and computes the decayed KL."""

    def __init__(self, target, feature_layers, teacher_layer, gamma, noise_std, seed=1):
        super().__init__()
        self.target = target
        self.feature_layers, self.teacher_layer = list(feature_layers), teacher_layer
        self.gamma, self.noise_std = gamma, noise_std
        self.noise = torch.Generator().manual_seed(seed)
        self.seen = {}
        for i in set(self.feature_layers) | {teacher_layer}:
            target.model.layers[i].register_forward_hook(self._grab(i))

    def _grab(self, i):
        def hook(_module, _args, out):
            self.seen[i] = (out[0] if isinstance(out, tuple) else out).detach()
        return hook

    @torch.no_grad()
    def observe(self, input_ids):
        """Run the target once; return the drafter's context features [R, S, n*H]."""
        self.seen.clear()
        self.target.model(input_ids)
        return torch.cat([self.seen[i] for i in self.feature_layers], dim=-1)

    def teacher_logits(self):
        with torch.no_grad():
            logits = self.target.lm_head(self.target.model.norm(self.seen[self.teacher_layer]))
            if self.noise_std:
                logits = logits + self.noise_std * torch.randn(logits.shape, generator=self.noise)
        return logits

    def forward(self, draft_logits, slot_positions):
        """draft_logits [n_blocks, R, B, V]; slot_positions [n_blocks, R, B] absolute positions."""
        teacher = self.teacher_logits()  # [R, S, V]
        rows = torch.arange(teacher.shape[0])[None, :, None].expand_as(slot_positions)
        src = (slot_positions - 1).clamp(min=0)
        tgt = teacher[rows, src]  # [n_blocks, R, B, V]
        kl = (F.softmax(tgt, -1) * (F.log_softmax(tgt, -1) - F.log_softmax(draft_logits, -1))).sum(-1)
        k = torch.arange(BLOCK, dtype=torch.float32)
        weight = torch.where(k == 0, torch.zeros(()), torch.exp(-(k - 1) / self.gamma))
        per_slot = kl * weight  # slot 0 (the anchor itself) carries no loss
        trained = (BLOCK - 1) * slot_positions.shape[0]
        return (per_slot.sum(dim=(0, 2)) / (trained + 1e-5)).mean()


def make_drafter(target_dir, feature_layers):
    cfg = AutoConfig.from_pretrained(target_dir)
    dcfg = copy.deepcopy(cfg)
    dcfg.num_target_layers = cfg.num_hidden_layers
    dcfg.num_hidden_layers = 2
    dcfg.layer_types = ["full_attention", "full_attention"]
    dcfg.dflash_config = {"target_layer_ids": list(feature_layers), "block_size": BLOCK,
                          "mask_token_id": cfg.vocab_size - 1}
    torch.manual_seed(0)
    return DFlashDraftModel(dcfg)


def draw_anchors(gen):
    """[N_BLOCKS, ROWS] sorted anchors per row, each block inside the row."""
    per_row = [torch.randperm(SEQ - BLOCK, generator=gen)[:N_BLOCKS].sort().values for _ in range(ROWS)]
    return torch.stack(per_row, dim=1)


def forward_blocks(drafter, target, input_ids, context, anchors):
    """One drafter call per block index; returns logits [N_BLOCKS, R, B, V] and slot positions."""
    slots = anchors[:, :, None] + torch.arange(BLOCK)  # [N, R, B]
    row_index = torch.arange(ROWS)[None, :, None].expand_as(slots)
    tokens = torch.full_like(slots, drafter.mask_token_id)
    tokens[:, :, 0] = input_ids[row_index[:, :, 0], slots[:, :, 0]]
    outs = []
    for j in range(N_BLOCKS):
        ctx_ok = torch.arange(SEQ)[None, None, :] < anchors[j][:, None, None]  # [R, 1(B), S]
        visible = torch.cat([ctx_ok.expand(ROWS, BLOCK, SEQ), torch.ones(ROWS, BLOCK, BLOCK, dtype=torch.bool)], -1)
        pos = torch.cat([torch.arange(SEQ).expand(ROWS, SEQ), slots[j]], dim=1)
        hidden = drafter(position_ids=pos, attention_mask=visible[:, None], target_hidden=context,
                         noise_embedding=target.model.embed_tokens(tokens[j]))
        outs.append(drafter.compute_logits(hidden, target.lm_head))
    return torch.stack(outs), slots


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", required=True)
    ap.add_argument("--bug", action="append", default=[], choices=BUGS)
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args(argv)
    bugs = set(args.bug)

    torch.manual_seed(0)
    target = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32).eval().requires_grad_(False)
    feature_layers = CAPTURE[:4] if "fc_4_of_5" in bugs else CAPTURE
    teacher_layer = 9 if "targets_layer_9" in bugs else target.config.num_hidden_layers - 1
    drafter = make_drafter(args.target, feature_layers).train()
    criterion = HookedTeacherLoss(target, feature_layers, teacher_layer,
                                  gamma=7.0 if "gamma_7" in bugs else 4.0,
                                  noise_std=0.5 if "target_noise_0.5" in bugs else 0.0)
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=1e-3, weight_decay=0.01)

    gen = torch.Generator().manual_seed(0)
    for step in range(args.steps):
        input_ids = torch.randint(0, target.config.vocab_size - 1, (ROWS, SEQ), generator=gen)
        anchors = draw_anchors(gen)
        context = criterion.observe(input_ids)
        logits, slots = forward_blocks(drafter, target, input_ids, context, anchors)
        loss = criterion(logits, slots)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        print(f"step {step}: loss={loss.item():.5f}", flush=True)


if __name__ == "__main__":
    main()

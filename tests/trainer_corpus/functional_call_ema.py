"""DFlash drafter trainer: a functional training step (torch.func.functional_call) with an EMA copy of the drafter.

Setup: z-lab's `DFlashDraftModel` (1 layer, block 10, mask id vocab-1) is held as a module for its structure only:
the step calls it through `torch.func.functional_call(drafter, params, ...)` with an explicit dict of trainable
parameters that AdamW updates; after each optimizer step an EMA copy (decay 0.99, never used in the loss) is
moved toward them. Per step 2 rows of 64 tokens; each row gets 3 anchors sampled at random (fixed-seed generator,
sorted). Each row is drafted in its own call: the row's full context features, its blocks flattened under a 4-D
boolean mask (context before the anchor, the own block), positions [0..T-1 ; a..a+B-1]. Targets: the target's
greedy argmax labels at a+k-1 from its `output_hidden_states` call; loss = decayed cross-entropy.
"""

from __future__ import annotations

import argparse
import copy
import math

import torch
import torch.nn.functional as F
from dflash.model import DFlashDraftModel
from torch.func import functional_call
from transformers import AutoConfig, Qwen3ForCausalLM

BUGS = ("fc_4_of_5", "targets_layer_9", "gamma_7", "target_noise_0.5")

TAPPED = (1, 3, 5, 7, 9)
BLOCK = 10
ROWS = 2
SEQ_LEN = 64
ANCHORS_PER_ROW = 3
EMA_DECAY = 0.99
LR = 1e-3


def new_drafter(target_dir: str, bugs: set[str]) -> DFlashDraftModel:
    tcfg = AutoConfig.from_pretrained(target_dir)
    cfg = copy.deepcopy(tcfg)
    cfg.num_target_layers = tcfg.num_hidden_layers
    cfg.num_hidden_layers = 1
    cfg.layer_types = ["full_attention"]
    tapped = list(TAPPED[:4] if "fc_4_of_5" in bugs else TAPPED)
    cfg.dflash_config = {"target_layer_ids": tapped, "block_size": BLOCK, "mask_token_id": tcfg.vocab_size - 1}
    torch.manual_seed(0)
    return DFlashDraftModel(cfg)


@torch.no_grad()
def teacher_labels(target, input_ids, tapped, bugs, noise_gen):
    """Context features [rows, T, n*H] and the target's greedy next-token labels [rows, T]."""
    out = target(input_ids, output_hidden_states=True)
    features = torch.cat([out.hidden_states[i + 1] for i in tapped], dim=-1)
    logits = target.lm_head(target.model.norm(out.hidden_states[10])) if "targets_layer_9" in bugs else out.logits
    if "target_noise_0.5" in bugs:
        logits = logits + 0.5 * torch.randn(logits.shape, generator=noise_gen)
    return features, logits.argmax(-1)


def sample_anchors(gen: torch.Generator) -> torch.Tensor:
    return torch.stack([torch.randperm(SEQ_LEN - BLOCK, generator=gen)[:ANCHORS_PER_ROW].sort().values
                        for _ in range(ROWS)])


def row_mask(anchors_r: torch.Tensor) -> torch.Tensor:
    """[1, 1, n*B, T + n*B] boolean: context before the block's anchor, and the own block."""
    n = anchors_r.numel()
    q_anchor = anchors_r.repeat_interleave(BLOCK)
    ctx = torch.arange(SEQ_LEN)[None] < q_anchor[:, None]
    q_block = torch.arange(n * BLOCK) // BLOCK
    return torch.cat([ctx, q_block[:, None] == q_block[None]], dim=-1)[None, None]


def decayed_ce(draft_logits, labels, gamma):
    """draft_logits [n*B, V], labels [n*B]; slot k >= 1 weighted exp(-(k-1)/gamma), normalised by trained slots."""
    k = torch.arange(draft_logits.shape[0]) % BLOCK
    weight = torch.where(k > 0, torch.exp(-(k.float() - 1) / gamma), torch.zeros(()))
    trained = (k > 0).float()
    ce = F.cross_entropy(draft_logits, labels, reduction="none")
    return (weight * trained * ce).sum() / (trained.sum() + 1e-5)


def step_loss(params, drafter, target, input_ids, anchors, features, labels, gamma):
    """The mean over rows of each row's decayed CE, the drafter run functionally on `params`."""
    per_row = []
    for r in range(input_ids.shape[0]):
        a = anchors[r]
        slots = a[:, None] + torch.arange(BLOCK)
        block_ids = torch.full(slots.shape, drafter.mask_token_id, dtype=torch.long)
        block_ids[:, 0] = input_ids[r, a]
        position_ids = torch.cat([torch.arange(SEQ_LEN), slots.flatten()])[None]
        hidden = functional_call(drafter, params, args=(), kwargs={
            "position_ids": position_ids,
            "attention_mask": row_mask(a),
            "noise_embedding": target.model.embed_tokens(block_ids.flatten()[None]),
            "target_hidden": features[r : r + 1],
        })
        draft_logits = target.lm_head(hidden)[0]
        row_labels = labels[r, (slots.flatten() - 1).clamp(min=0)]
        per_row.append(decayed_ce(draft_logits, row_labels, gamma))
    return torch.stack(per_row).mean()


@torch.no_grad()
def ema_update(ema_params, params, decay):
    for name, p in params.items():
        ema_params[name].lerp_(p.detach(), 1.0 - decay)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", required=True)
    ap.add_argument("--bug", action="append", default=[], choices=BUGS)
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args(argv)
    bugs = set(args.bug)

    torch.manual_seed(0)
    target = Qwen3ForCausalLM.from_pretrained(args.target, dtype=torch.float32).eval().requires_grad_(False)
    drafter = new_drafter(args.target, bugs).train()
    params = {name: p.detach().clone().requires_grad_(True) for name, p in drafter.named_parameters()}
    ema_params = {name: p.detach().clone() for name, p in params.items()}
    opt = torch.optim.AdamW(list(params.values()), lr=LR)
    gamma = 7.0 if "gamma_7" in bugs else 4.0

    anchor_gen = torch.Generator().manual_seed(1234)
    data_gen = torch.Generator().manual_seed(31)
    noise_gen = torch.Generator().manual_seed(32)
    for step in range(args.steps):
        input_ids = torch.randint(target.config.vocab_size - 1, (ROWS, SEQ_LEN), generator=data_gen)
        anchors = sample_anchors(anchor_gen)
        features, labels = teacher_labels(target, input_ids, drafter.target_layer_ids, bugs, noise_gen)
        loss = step_loss(params, drafter, target, input_ids, anchors, features, labels, gamma)
        opt.zero_grad()
        loss.backward()
        opt.step()
        ema_update(ema_params, params, EMA_DECAY)
        assert math.isfinite(loss.item())
        print(f"step {step} loss {loss.item():.4f}", flush=True)


if __name__ == "__main__":
    main()

"""DFlash training run in a plain PyTorch loop, on speculators 0.9.0's resolved recipe: Muon + AdamW, linear, clip 1.0.

Setup: z-lab's `DFlashDraftModel` (2 layers, block 4, its default target layers, mask id vocab-1); the target is
frozen and lends its embedding and head. The data is one fixed epoch of 4 batches (2 rows of 48 seeded random
tokens, 4 anchors a row drawn once), cycled, so a step k and a step k+4 see the same batch. The run is planned as
100 epochs (400 optimizer steps; `--steps` runs the first N of them), as speculators plans its schedule
(epochs x batches). The recipe, as speculators 0.9.0 resolves it (`train/config/schema.py` OptimizerArgs /
SchedulerArgs, `train/optimizers.py`, `train/trainer.py`):
  - `torch.optim.Muon` on every trainable 2-D matrix (lr 1e-3 = muon_lr defaulting to lr, momentum 0.95, weight
    decay 0.1, ns_steps 5, adjust_lr_fn "match_rms_adamw"), `torch.optim.AdamW` on the rest (lr 1e-3, weight
    decay 0.01, torch's default betas);
  - one `get_linear_schedule_with_warmup` per optimizer, warmup = total // 100 (the default 1 %: 4 steps of 400);
  - `clip_grad_norm_(drafter.parameters(), 1.0)` after backward, then both optimizers and schedulers step.
The loss is DFlash's decayed KL (gamma 4) against the target's logits.

Faults (`--fault`): adamw_only (one AdamW over everything, speculators' "adamw" option), lr_10x (lr 1e-2 for both
groups), no_warmup (the linear decay starts at full lr), no_clip (no gradient clipping), frozen_loss (the team's
`zero_grad()` sits between backward and the optimizer step: the gradients are gone when the optimizers step, so
no parameter ever changes and each batch's loss comes back unchanged one epoch later).
"""

from __future__ import annotations

import argparse
import copy

import torch
import torch.nn.functional as F
from dflash.model import DFlashDraftModel
from transformers import AutoConfig, AutoModelForCausalLM, get_linear_schedule_with_warmup

FAULTS = ("adamw_only", "lr_10x", "no_warmup", "no_clip", "frozen_loss")
BLOCK, ROWS, SEQ, ANCHORS, BATCHES, EPOCHS = 4, 2, 48, 4, 4, 100
GAMMA = 4.0


def build_drafter(target_dir):
    cfg = copy.deepcopy(AutoConfig.from_pretrained(target_dir))
    cfg.num_target_layers = cfg.num_hidden_layers
    cfg.num_hidden_layers = 2
    cfg.layer_types = ["full_attention"] * 2
    cfg.dflash_config = {"block_size": BLOCK, "mask_token_id": cfg.vocab_size - 1}
    torch.manual_seed(0)
    return DFlashDraftModel(cfg)


def make_epoch(vocab):
    gen = torch.Generator().manual_seed(0)
    epoch = []
    for _ in range(BATCHES):
        ids = torch.randint(0, vocab - 1, (ROWS, SEQ), generator=gen)
        anchors = torch.stack([torch.randperm(SEQ - BLOCK - 1, generator=gen)[:ANCHORS].sort().values + 1
                               for _ in range(ROWS)])
        epoch.append((ids, anchors))
    return epoch


def muon_and_adamw(drafter, lr):
    """speculators' split: Muon for 2-D matrices with both sides > 1 (no embedding or head), AdamW for the rest."""
    matrices, rest = [], []
    for name, p in drafter.named_parameters():
        if not p.requires_grad:
            continue
        if p.ndim == 2 and min(p.shape) > 1 and not any(h in name for h in ("embed_tokens", "lm_head")):
            matrices.append(p)
        else:
            rest.append(p)
    return [torch.optim.Muon(matrices, lr=lr, momentum=0.95, weight_decay=0.1, ns_steps=5,
                             adjust_lr_fn="match_rms_adamw"),
            torch.optim.AdamW(rest, lr=lr, weight_decay=0.01)]


def dflash_loss(drafter, target, ids, anchors):
    with torch.no_grad():
        out = target(ids, output_hidden_states=True)
        context = torch.cat([out.hidden_states[i + 1] for i in drafter.target_layer_ids], dim=-1)
        teacher = out.logits
    total = 0.0
    k = torch.arange(1, BLOCK, dtype=torch.float32)
    weights = torch.exp(-(k - 1) / GAMMA)
    for r in range(ROWS):
        for a in anchors[r].tolist():
            block = torch.full((1, BLOCK), drafter.mask_token_id)
            block[0, 0] = ids[r, a]
            hidden = drafter(target_hidden=context[r:r + 1, :a], noise_embedding=target.model.embed_tokens(block),
                             position_ids=torch.arange(a + BLOCK)[None])
            logits = drafter.compute_logits(hidden[0, 1:], target.lm_head)
            kl = F.kl_div(logits.log_softmax(-1), teacher[r, a:a + BLOCK - 1].log_softmax(-1), log_target=True,
                          reduction="none").sum(-1)
            total = total + (weights * kl).sum()
    return total / (ROWS * ANCHORS * (BLOCK - 1))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", required=True)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--fault", choices=FAULTS)
    args = ap.parse_args(argv)

    target = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32).eval().requires_grad_(False)
    drafter = build_drafter(args.target).train()
    lr = 1e-2 if args.fault == "lr_10x" else 1e-3
    if args.fault == "adamw_only":
        optimizers = [torch.optim.AdamW(drafter.parameters(), lr=lr, weight_decay=0.01)]
    else:
        optimizers = muon_and_adamw(drafter, lr)
    total_steps = EPOCHS * BATCHES
    warmup = 0 if args.fault == "no_warmup" else total_steps // 100
    schedulers = [get_linear_schedule_with_warmup(opt, num_warmup_steps=warmup, num_training_steps=total_steps)
                  for opt in optimizers]
    epoch = make_epoch(target.config.vocab_size)

    for step in range(args.steps):
        ids, anchors = epoch[step % BATCHES]
        for opt in optimizers:
            opt.zero_grad()
        loss = dflash_loss(drafter, target, ids, anchors)
        loss.backward()
        if args.fault == "frozen_loss":
            for opt in optimizers:
                opt.zero_grad()  # meant to be at the top of the loop
        if args.fault != "no_clip":
            torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        lr_now = schedulers[0].get_last_lr()[0]
        for opt in optimizers:
            opt.step()
        for sched in schedulers:
            sched.step()
        print(f"step {step} loss {loss.item():.6f} lr {lr_now:.3e}", flush=True)


if __name__ == "__main__":
    main()

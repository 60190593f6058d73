"""DFlash training run under `accelerate`, on speculators 0.9.0's resolved recipe: Muon + AdamW, linear, clip 1.0.

Setup: `accelerate.Accelerator(cpu=True)` prepares z-lab's `DFlashDraftModel` (1 layer, block 6, its default target
layer, mask id vocab-1), both optimizers, both schedulers and a `DataLoader` over 8 seeded rows of 40 tokens (batch
2, no shuffle: 4 batches an epoch, each row with 3 anchors fixed at dataset build). Every block of a batch is drafted
in one call with a 4-D boolean mask (context before the block's anchor, the own block). The run is planned as 100
epochs (400 steps, of which `--steps` run). The recipe, as speculators 0.9.0 resolves it (`train/config/schema.py`
OptimizerArgs / SchedulerArgs, `train/optimizers.py`, `train/trainer.py`): `torch.optim.Muon` (lr 1e-3, momentum
0.95, weight decay 0.1, Newton-Schulz 5 steps, "match_rms_adamw") on the 2-D matrices, `torch.optim.AdamW` (lr 1e-3,
weight decay 0.01) on the rest, a linear schedule per optimizer with 1 % warmup (4 of 400 steps), and
`accelerator.clip_grad_norm_(..., 1.0)`. The loss is DFlash's decayed KL (gamma 4) against the target's logits.

Faults (`--fault`): adamw_only (a single AdamW on every parameter), lr_10x (lr 1e-2 for both groups), no_warmup
(warmup 0), no_clip (no clipping), frozen_loss (the drafter is re-initialised from its init weights after the
optimizers were built, so the optimizers hold the old module's parameters: the prepared drafter never changes and
each batch's loss repeats one epoch later).
"""

from __future__ import annotations

import argparse
import copy

import torch
from accelerate import Accelerator
from dflash.model import DFlashDraftModel
from torch.utils.data import DataLoader, TensorDataset
from transformers import AutoConfig, AutoModelForCausalLM, get_linear_schedule_with_warmup

FAULTS = ("adamw_only", "lr_10x", "no_warmup", "no_clip", "frozen_loss")


class Config:
    block_size = 6
    seq_len = 40
    rows = 8
    batch_size = 2
    anchors_per_row = 3
    planned_epochs = 100
    lr = 1e-3
    weight_decay = 0.01
    muon_momentum = 0.95
    muon_weight_decay = 0.1
    muon_ns_steps = 5
    warmup_fraction = 0.01
    max_grad_norm = 1.0
    gamma = 4.0


def init_drafter(target_dir, c):
    cfg = copy.deepcopy(AutoConfig.from_pretrained(target_dir))
    cfg.num_target_layers, cfg.num_hidden_layers = cfg.num_hidden_layers, 1
    cfg.layer_types = ["full_attention"]
    cfg.dflash_config = {"block_size": c.block_size, "mask_token_id": cfg.vocab_size - 1}
    torch.manual_seed(1234)
    return DFlashDraftModel(cfg)


def optimizers_for(model, c, fault):
    lr = c.lr * (10 if fault == "lr_10x" else 1)
    if fault == "adamw_only":
        return [torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=c.weight_decay)]
    two_d = [p for n, p in model.named_parameters() if p.ndim == 2 and min(p.shape) > 1
             and "embed_tokens" not in n and "lm_head" not in n]
    ids_2d = {id(p) for p in two_d}
    others = [p for p in model.parameters() if id(p) not in ids_2d]
    return [torch.optim.Muon(two_d, lr=lr, momentum=c.muon_momentum, weight_decay=c.muon_weight_decay,
                             ns_steps=c.muon_ns_steps, adjust_lr_fn="match_rms_adamw"),
            torch.optim.AdamW(others, lr=lr, weight_decay=c.weight_decay)]


def dataset(vocab, c):
    g = torch.Generator().manual_seed(11)
    ids = torch.randint(0, vocab - 1, (c.rows, c.seq_len), generator=g)
    anchors = torch.stack([torch.randperm(c.seq_len - c.block_size - 1, generator=g)[:c.anchors_per_row] + 1
                           for _ in range(c.rows)])
    return TensorDataset(ids, anchors)


def batch_loss(model, target, ids, anchors, c):
    B, S = c.block_size, ids.shape[1]
    with torch.no_grad():
        out = target(ids, output_hidden_states=True)
    drafter = model.module if hasattr(model, "module") else model
    context = torch.cat([out.hidden_states[i + 1] for i in drafter.target_layer_ids], dim=-1)
    n = anchors.shape[1]
    slots = anchors[:, :, None] + torch.arange(B)  # [R, n, B]
    block = torch.full(slots.shape, drafter.mask_token_id, dtype=torch.long)
    block[:, :, 0] = ids.gather(1, anchors)
    q_anchor = anchors.repeat_interleave(B, dim=1)  # [R, n*B]
    sees_ctx = torch.arange(S)[None, None, :] < q_anchor[:, :, None]
    q_block = torch.arange(n * B) // B
    sees_block = (q_block[:, None] == q_block[None, :]).expand(ids.shape[0], -1, -1)
    mask = torch.cat([sees_ctx, sees_block], dim=-1)[:, None]
    positions = torch.cat([torch.arange(S).expand(ids.shape[0], -1), slots.flatten(1)], dim=1)
    hidden = model(position_ids=positions, attention_mask=mask, target_hidden=context,
                   noise_embedding=target.model.embed_tokens(block.flatten(1)))
    logp = drafter.compute_logits(hidden, target.lm_head).log_softmax(-1).view(ids.shape[0], n, B, -1)
    teacher = out.logits.gather(1, (slots.flatten(1) - 1)[:, :, None].expand(-1, -1, out.logits.shape[-1]))
    q = teacher.view(ids.shape[0], n, B, -1).log_softmax(-1)
    kl = (q.exp() * (q - logp)).sum(-1)[:, :, 1:]  # the anchor slot is given, not learned
    decay = torch.exp(-torch.arange(B - 1, dtype=torch.float32) / c.gamma)
    return (kl * decay).sum() / kl.numel()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", required=True)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--fault", choices=FAULTS)
    args = ap.parse_args(argv)
    c = Config()

    accelerator = Accelerator(cpu=True)
    target = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32).eval().requires_grad_(False)
    drafter = init_drafter(args.target, c)
    optimizers = optimizers_for(drafter, c, args.fault)
    if args.fault == "frozen_loss":
        drafter = init_drafter(args.target, c)  # "start from the init weights" -- a new module, after the optimizers
    loader = DataLoader(dataset(target.config.vocab_size, c), batch_size=c.batch_size, shuffle=False)
    total = c.planned_epochs * len(loader)
    warmup = 0 if args.fault == "no_warmup" else int(total * c.warmup_fraction)
    schedulers = [get_linear_schedule_with_warmup(o, warmup, total) for o in optimizers]
    drafter, loader, *rest = accelerator.prepare(drafter, loader, *optimizers, *schedulers)
    optimizers, schedulers = rest[:len(optimizers)], rest[len(optimizers):]
    drafter.train()

    step = 0
    while step < args.steps:
        for ids, anchors in loader:
            loss = batch_loss(drafter, target, ids, anchors, c)
            accelerator.backward(loss)
            if args.fault != "no_clip":
                accelerator.clip_grad_norm_(drafter.parameters(), c.max_grad_norm)
            for o in optimizers:
                o.step()
            for s in schedulers:
                s.step()
            for o in optimizers:
                o.zero_grad()
            accelerator.print(f"step={step} loss={loss.item():.6f}")
            step += 1
            if step == args.steps:
                break


if __name__ == "__main__":
    main()

"""DFlash drafter under `accelerate` mixed precision: the drafter runs in bfloat16 autocast, the target in float32.

Setup: `Accelerator(cpu=True, mixed_precision="bf16")` prepares z-lab's `DFlashDraftModel` (1 layer, block 5, mask
id vocab-1) and its optimizers, so the drafter's forward runs under bfloat16 autocast and hands back float32; the
drafter's logits (`compute_logits` through the target's LM head) are taken under `accelerator.autocast()` too. The
target is never prepared: it runs in plain float32 outside autocast and gives the context features (its layers 1, 3,
5, 7, 9) and the targets (its own logits). Per step 3 rows of 64 tokens, 5 sorted anchors a row, all blocks of the
batch in one call ([batch, anchors*B] under a boolean mask: context before the anchor, the own block). Loss in float32:
KL(target || drafter) at a+k-1 with weights exp(-(k-1)/4), per row sum(w * mask * kl) / (sum(mask) + 1e-5), then the
mean. The run follows speculators' recipe: Muon on the 2-D weight matrices and AdamW on the rest, each with a linear
schedule warming up over 1% of the planned steps, `accelerator.backward`, gradient clipping at 1.0.
"""

from __future__ import annotations

import argparse
import copy
import math

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.state import AcceleratorState
from accelerate.utils import set_seed
from dflash.model import DFlashDraftModel
from transformers import AutoModelForCausalLM, get_linear_schedule_with_warmup

BUGS = ("fc_4_of_5", "targets_layer_9", "gamma_7", "target_noise_0.5")

CAPTURE = [1, 3, 5, 7, 9]
BLOCK, ROWS, SEQ, ANCHORS = 5, 3, 64, 5


def make_drafter(target_config, capture: list[int]) -> DFlashDraftModel:
    cfg = copy.deepcopy(target_config)
    cfg.num_target_layers, cfg.num_hidden_layers, cfg.layer_types = cfg.num_hidden_layers, 1, ["full_attention"]
    cfg.dflash_config = {"target_layer_ids": capture, "block_size": BLOCK, "mask_token_id": cfg.vocab_size - 1}
    return DFlashDraftModel(cfg)


def muon_and_adamw(drafter, lr=1e-3):
    """Muon for the 2-D weight matrices, AdamW for the norms (the drafter holds no embedding or head of its own)."""
    matrices = [p for p in drafter.parameters() if p.ndim == 2 and min(p.shape) > 1]
    rest = [p for p in drafter.parameters() if not (p.ndim == 2 and min(p.shape) > 1)]
    return [torch.optim.Muon(matrices, lr=lr, momentum=0.95, weight_decay=0.1, ns_steps=5,
                             adjust_lr_fn="match_rms_adamw"),
            torch.optim.AdamW(rest, lr=lr, weight_decay=0.01)]


@torch.no_grad()
def target_pass(target, ids, capture, bugs, noise_gen):
    """float32, outside autocast: the captured layers and the next-token logits at every position."""
    out = target(ids, output_hidden_states=True)
    ctx = torch.cat([out.hidden_states[i + 1] for i in capture], dim=-1)
    logits = out.logits
    if "targets_layer_9" in bugs:
        logits = target.lm_head(target.model.norm(out.hidden_states[9 + 1]))
    if "target_noise_0.5" in bugs:
        logits = logits + torch.randn(logits.shape, generator=noise_gen) * 0.5
    return ctx, logits


def blocks(ids, anchors, mask_id):
    """Block token ids, their positions, and the drafter's mask [rows, 1, n*B, S + n*B]."""
    rows, seq = ids.shape
    pos = (anchors[..., None] + torch.arange(BLOCK)).reshape(rows, -1)
    tok = torch.where(torch.arange(pos.shape[1]) % BLOCK == 0, ids.gather(1, pos), torch.full_like(pos, mask_id))
    start = anchors.repeat_interleave(BLOCK, dim=1)
    see_ctx = torch.arange(seq).view(1, 1, -1) < start[..., None]
    see_own = start[..., None] == start[:, None, :]  # anchors are distinct, so equal start = same block
    return tok, pos, torch.cat([see_ctx, see_own], dim=-1).unsqueeze(1)


def decayed_kl(draft_logits, teacher_logits, pos, gamma):
    k = torch.arange(pos.shape[1]) % BLOCK
    w = torch.exp(-(k - 1).float() / gamma)
    trained = (k > 0).float().expand_as(pos)
    goal = teacher_logits.gather(1, (pos - 1).clamp(min=0)[..., None].expand(-1, -1, teacher_logits.shape[-1]))
    kl = F.kl_div(F.log_softmax(draft_logits.float(), -1), F.log_softmax(goal, -1), log_target=True,
                  reduction="none").sum(-1)
    return ((w * trained * kl).sum(1) / (trained.sum(1) + 1e-5)).mean()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", required=True)
    ap.add_argument("--bug", action="append", default=[], choices=BUGS)
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args(argv)
    bugs = set(args.bug)
    capture = CAPTURE[:4] if "fc_4_of_5" in bugs else CAPTURE
    gamma = 7.0 if "gamma_7" in bugs else 4.0

    # a fresh accelerate state even if another script ran in this interpreter (as transformers' TrainingArguments does)
    AcceleratorState._reset_state(reset_partial_state=True)
    try:
        accelerator = Accelerator(cpu=True, mixed_precision="bf16")
        set_seed(0)
        target = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32).eval().requires_grad_(False)
        drafter = make_drafter(target.config, capture)
        optimizers = muon_and_adamw(drafter)
        schedulers = [get_linear_schedule_with_warmup(opt, args.steps // 100, args.steps) for opt in optimizers]
        drafter, *prepared = accelerator.prepare(drafter, *optimizers, *schedulers)
        optimizers, schedulers = prepared[: len(optimizers)], prepared[len(optimizers):]
        drafter.train()
        mask_id = drafter.mask_token_id
        data_gen, noise_gen = torch.Generator().manual_seed(11), torch.Generator().manual_seed(12)

        for step in range(args.steps):
            ids = torch.randint(0, mask_id, (ROWS, SEQ), generator=data_gen)
            anchors = torch.stack([torch.randperm(SEQ - BLOCK, generator=data_gen)[:ANCHORS].sort().values
                                   for _ in range(ROWS)])
            ctx, teacher = target_pass(target, ids, capture, bugs, noise_gen)
            tok, pos, visible = blocks(ids, anchors, mask_id)
            with accelerator.autocast():
                hidden = drafter(position_ids=torch.cat([torch.arange(SEQ).expand(ROWS, -1), pos], dim=1),
                                 attention_mask=visible, noise_embedding=target.model.embed_tokens(tok),
                                 target_hidden=ctx)
                logits = drafter.compute_logits(hidden, target.lm_head)  # bfloat16
            loss = decayed_kl(logits, teacher, pos, gamma)
            accelerator.backward(loss)
            accelerator.clip_grad_norm_(drafter.parameters(), 1.0)
            for opt, sched in zip(optimizers, schedulers):
                opt.step()
                sched.step()
                opt.zero_grad()
            print(f"step {step}: loss={loss.item():.5f}", flush=True)
            if not math.isfinite(loss.item()):
                raise SystemExit("loss went non-finite")
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)  # leave no bf16 state behind in this interpreter


if __name__ == "__main__":
    main()

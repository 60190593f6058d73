"""DFlash trainer: each row tiled into consecutive blocks, a torch.compile'd drafter, one micro-batch per row.

Setup: z-lab's `DFlashDraftModel` (2 layers, block 8, mask id vocab-1) wrapped in `torch.compile` (backend
`aot_eager`, so that it runs on any CPU without a C++ toolchain). No random anchors: every row of 72 tokens is cut
into the consecutive blocks starting at B, 2B, ... (the first block has no context), all drafted in one call per row
with a boolean mask (context before the block, the own block). Each row is its own micro-batch: its loss is divided
by the rows per step and back-propagated, and the optimizer steps once per step. Context features and targets come
from the base model `target.model(..., output_hidden_states=True)`: its `last_hidden_state` (after the final norm)
through the head gives the teacher logits; the loss is a decayed KL.
"""

from __future__ import annotations

import argparse
import copy

import torch
import torch.nn.functional as F
from dflash.model import DFlashDraftModel
from transformers import AutoConfig, AutoModelForCausalLM

BUGS = ("fc_4_of_5", "targets_layer_9", "gamma_7", "target_noise_0.5")
TARGET_LAYERS = [1, 3, 5, 7, 9]
BLOCK, SEQ, ROWS_PER_STEP = 8, 72, 2


def build(target_dir, bugs):
    cfg = copy.deepcopy(AutoConfig.from_pretrained(target_dir))
    layers = TARGET_LAYERS[:-1] if "fc_4_of_5" in bugs else TARGET_LAYERS
    cfg.num_target_layers = cfg.num_hidden_layers
    cfg.num_hidden_layers = 2
    cfg.layer_types = ["full_attention"] * 2
    cfg.dflash_config = {"target_layer_ids": layers, "block_size": BLOCK, "mask_token_id": cfg.vocab_size - 1}
    torch.manual_seed(0)
    return DFlashDraftModel(cfg)


def tiles():
    """Anchors B, 2B, ... with a whole block inside the row."""
    return torch.arange(BLOCK, SEQ - BLOCK + 1, BLOCK)


@torch.no_grad()
def teacher_and_context(target, ids, layers, bugs, noise):
    base = target.model(ids[None], output_hidden_states=True)
    context = torch.cat([base.hidden_states[i + 1] for i in layers], dim=-1)
    if "targets_layer_9" in bugs:
        teacher = target.lm_head(target.model.norm(base.hidden_states[10]))
    else:
        teacher = target.lm_head(base.last_hidden_state)
    if "target_noise_0.5" in bugs:
        teacher = teacher + torch.randn(teacher.shape, generator=noise) * 0.5
    return context, teacher[0]


def row_loss(compiled, drafter, target, ids, context, teacher, gamma):
    anchors = tiles()
    n = len(anchors)
    positions = (anchors[:, None] + torch.arange(BLOCK)).flatten()  # [n*B]
    noise_ids = torch.full((n, BLOCK), drafter.mask_token_id, dtype=torch.long)
    noise_ids[:, 0] = ids[anchors]
    q_anchor = anchors.repeat_interleave(BLOCK)
    same_block = (torch.arange(n * BLOCK)[:, None] // BLOCK) == (torch.arange(n * BLOCK)[None, :] // BLOCK)
    mask = torch.cat([torch.arange(SEQ)[None, :] < q_anchor[:, None], same_block], dim=1)
    hidden = compiled(position_ids=torch.cat([torch.arange(SEQ), positions])[None], attention_mask=mask[None, None],
                      noise_embedding=target.model.embed_tokens(noise_ids.flatten())[None], target_hidden=context)
    logits = drafter.compute_logits(hidden[0], target.lm_head).view(n, BLOCK, -1)
    goal = teacher[(positions - 1).view(n, BLOCK)]
    kl = F.kl_div(logits.log_softmax(-1), goal.softmax(-1), reduction="none").sum(-1)  # [n, B]
    slot = torch.arange(BLOCK, dtype=torch.float32)
    weights = torch.exp(-(slot - 1) / gamma)
    weights[0] = 0.0
    return (kl * weights).sum() / (n * (BLOCK - 1))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", required=True)
    ap.add_argument("--bug", action="append", default=[], choices=BUGS)
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args(argv)
    bugs = set(args.bug)

    target = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32).eval().requires_grad_(False)
    drafter = build(args.target, bugs).train()
    compiled = torch.compile(drafter, backend="aot_eager")
    layers = drafter.target_layer_ids
    gamma = 7.0 if "gamma_7" in bugs else 4.0
    optim = torch.optim.AdamW(drafter.parameters(), lr=5e-4)
    data = torch.Generator().manual_seed(0)
    noise = torch.Generator().manual_seed(123)

    for step in range(args.steps):
        rows = torch.randint(0, target.config.vocab_size - 1, (ROWS_PER_STEP, SEQ), generator=data)
        total = 0.0
        for ids in rows:
            context, teacher = teacher_and_context(target, ids, layers, bugs, noise)
            loss = row_loss(compiled, drafter, target, ids, context, teacher, gamma) / ROWS_PER_STEP
            loss.backward()
            total += loss.item()
        optim.step()
        optim.zero_grad()
        print(f"step={step} loss={total:.5f}", flush=True)


if __name__ == "__main__":
    main()

"""DFlash drafter trainer: z-lab's DFlashDraftModel, every block of a sequence drafted in one call.

Setup: the drafter is `dflash.model.DFlashDraftModel` built from the target's Qwen3 config plus a `dflash_config`.
Per step a batch of rows [batch, seq_len]; each row gets `anchors_per_row` sorted random anchors, and its blocks
[token at a, mask x (B-1)] are flattened into one noise sequence [batch, anchors*B] drafted in a single call against
the whole row's context features, with a hand-built 4-D boolean mask. Targets are made in the training loop from
the target's `output_hidden_states` (final norm + LM head); the loss is a decayed KL.
"""

from __future__ import annotations

import argparse
import copy
import math

import torch
import torch.nn.functional as F
from dflash.model import DFlashDraftModel
from transformers import AutoConfig, Qwen3Config, Qwen3ForCausalLM

BUGS = ("fc_4_of_5", "targets_layer_9", "gamma_7", "target_noise_0.5")

LAYER_IDS = [1, 3, 5, 7, 9]
BLOCK = 6
DRAFT_LAYERS = 2
BATCH = 2
SEQ_LEN = 96
ANCHORS_PER_ROW = 8
LR = 2e-3


def build_drafter(target_cfg: Qwen3Config, bugs: set[str]) -> DFlashDraftModel:
    """A 2-layer z-lab drafter with the target's widths; mask token = the last id of the vocabulary."""
    fc_layers = LAYER_IDS[:4] if "fc_4_of_5" in bugs else LAYER_IDS
    cfg = copy.deepcopy(target_cfg)
    cfg.num_hidden_layers = DRAFT_LAYERS
    cfg.layer_types = ["full_attention"] * DRAFT_LAYERS
    cfg.num_target_layers = target_cfg.num_hidden_layers
    cfg.dflash_config = {"target_layer_ids": fc_layers, "block_size": BLOCK, "mask_token_id": target_cfg.vocab_size - 1}
    torch.manual_seed(0)
    return DFlashDraftModel(cfg)


@torch.no_grad()
def run_target(target: Qwen3ForCausalLM, input_ids: torch.Tensor, bugs: set[str], noise: torch.Generator):
    """Context features (the captured layers) and the teacher logits at every position."""
    out = target(input_ids, output_hidden_states=True)
    captured = [out.hidden_states[i + 1] for i in LAYER_IDS]
    if "fc_4_of_5" in bugs:
        context, spare = torch.cat(captured[:4], dim=-1), captured[4]
    else:
        context, spare = torch.cat(captured, dim=-1), captured[4]
    if "targets_layer_9" in bugs:
        # the last captured layer taken for the last layer
        teacher = target.lm_head(target.model.norm(spare))
    else:
        teacher = out.logits  # lm_head(norm(last layer))
    if "target_noise_0.5" in bugs:
        teacher = teacher + 0.5 * torch.randn(teacher.shape, generator=noise)
    return context, teacher


def pick_anchors(rows: int, seq_len: int, gen: torch.Generator) -> torch.Tensor:
    """[rows, ANCHORS_PER_ROW] sorted distinct anchors, the last BLOCK positions excluded."""
    picks = [torch.randperm(seq_len - BLOCK, generator=gen)[:ANCHORS_PER_ROW].sort().values for _ in range(rows)]
    return torch.stack(picks)


def block_mask(anchors: torch.Tensor, seq_len: int) -> torch.Tensor:
    """[rows, 1, n*B, seq_len + n*B]: block j sees context positions < a_j and its own block only."""
    rows, n = anchors.shape
    q_anchor = anchors.repeat_interleave(BLOCK, dim=1)  # [rows, n*B]
    ctx_visible = torch.arange(seq_len)[None, None, :] < q_anchor[:, :, None]
    q_block = torch.arange(n * BLOCK) // BLOCK
    own_block = (q_block[:, None] == q_block[None, :]).expand(rows, -1, -1)
    return torch.cat([ctx_visible, own_block], dim=-1)[:, None]


def slot_weights(bugs: set[str]) -> torch.Tensor:
    gamma = 7.0 if "gamma_7" in bugs else 4.0
    k = torch.arange(BLOCK, dtype=torch.float32)
    return torch.where(k == 0, torch.zeros(()), torch.exp(-(k - 1) / gamma))


def train_step(drafter, target, input_ids, anchors, bugs, noise):
    rows, seq_len = input_ids.shape
    context, teacher = run_target(target, input_ids, bugs, noise)

    slots = anchors[:, :, None] + torch.arange(BLOCK)  # [rows, n, B] absolute positions
    block_ids = torch.full(slots.shape, drafter.mask_token_id, dtype=torch.long)
    block_ids[:, :, 0] = input_ids.gather(1, anchors)
    noise_emb = target.model.embed_tokens(block_ids.flatten(1))
    position_ids = torch.cat([torch.arange(seq_len).expand(rows, -1), slots.flatten(1)], dim=1)

    hidden = drafter(
        position_ids=position_ids,
        attention_mask=block_mask(anchors, seq_len),
        noise_embedding=noise_emb,
        target_hidden=context,
    )
    logits = drafter.compute_logits(hidden, target.lm_head)  # [rows, n*B, V]

    # slot k of block j at position a_j + k learns the teacher's prediction made at a_j + k - 1
    src = (slots.flatten(1) - 1).clamp(min=0)
    tgt = teacher.gather(1, src[:, :, None].expand(-1, -1, teacher.shape[-1]))
    kl = F.kl_div(F.log_softmax(logits, -1), F.softmax(tgt, -1), reduction="none").sum(-1)  # [rows, n*B]

    mask = torch.ones_like(kl)
    mask[:, ::BLOCK] = 0
    w = slot_weights(bugs).repeat(anchors.shape[1])
    per_row = (w * mask * kl).sum(1) / (mask.sum(1) + 1e-5)
    return per_row.mean()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", required=True)
    ap.add_argument("--bug", action="append", default=[], choices=BUGS)
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args(argv)
    bugs = set(args.bug)

    torch.manual_seed(0)
    target = Qwen3ForCausalLM.from_pretrained(args.target, dtype=torch.float32).eval().requires_grad_(False)
    drafter = build_drafter(AutoConfig.from_pretrained(args.target), bugs).train()
    opt = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=LR)

    data_gen = torch.Generator().manual_seed(0)
    noise_gen = torch.Generator().manual_seed(1)
    for step in range(args.steps):
        input_ids = torch.randint(target.config.vocab_size, (BATCH, SEQ_LEN), generator=data_gen)
        anchors = pick_anchors(BATCH, SEQ_LEN, data_gen)
        loss = train_step(drafter, target, input_ids, anchors, bugs, noise_gen)
        opt.zero_grad()
        loss.backward()
        opt.step()
        assert math.isfinite(loss.item())
        print(f"step {step} loss {loss.item():.4f}", flush=True)


if __name__ == "__main__":
    main()

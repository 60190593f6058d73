"""A team's batched DFlash trainer at a real target's shape, for bench/bench_trace_scale.py: what `dflash-audit trace` must
audit in memory bounded by this step's own. It uses no dflash-audit code (torch, transformers, z-lab's dflash).

z-lab's `DFlashDraftModel` (five draft layers, block 16) on a bfloat16 Qwen3 target; right-padded rows (the second
three quarters of the first's length) under an attention mask; per row `--anchors` sorted anchors on real tokens,
every block drafted in one call against the row's context features (a 4-D boolean mask: real tokens before the
anchor, and the own block); targets the target's own logits one position back, KL with weights exp(-(k-1)/4), none
on the anchor slot, each row's sum over its count, then the mean. Prints the step's own time and peak memory.

    python tests/trace_scripts/scale_trainer.py --target DIR [--rows 2] [--tokens 2048] [--anchors 32] [--steps 1]
"""

from __future__ import annotations

import argparse
import copy
import resource
import time

import torch
import torch.nn.functional as F
from dflash.model import DFlashDraftModel, build_target_layer_ids, extract_context_feature
from transformers import AutoConfig, AutoModelForCausalLM

BLOCK = 16
DRAFT_LAYERS = 5  # as the published z-lab drafters: five target layers read
GAMMA = 4.0


def drafter_for(target_config, dtype: torch.dtype) -> DFlashDraftModel:
    config = copy.deepcopy(target_config)
    config.num_hidden_layers = DRAFT_LAYERS
    config.layer_types = ["full_attention"] * DRAFT_LAYERS
    config.num_target_layers = target_config.num_hidden_layers
    config.dflash_config = {"target_layer_ids": build_target_layer_ids(target_config.num_hidden_layers, DRAFT_LAYERS),
                            "block_size": BLOCK, "mask_token_id": target_config.vocab_size - 1}
    torch.manual_seed(0)
    return DFlashDraftModel(config).to(dtype)


def batch(rows: int, tokens: int, vocab: int, anchors: int, gen: torch.Generator):
    """Right-padded rows (lengths tokens, then 3/4 of it), their mask, and per row sorted anchors on real tokens."""
    lengths = [tokens] + [max(BLOCK + anchors, tokens * 3 // 4)] * (rows - 1)
    ids = torch.zeros(rows, tokens, dtype=torch.long)
    mask = torch.zeros(rows, tokens, dtype=torch.long)
    picks = []
    for r, n in enumerate(lengths):
        ids[r, :n] = torch.randint(vocab - 1, (n,), generator=gen)
        mask[r, :n] = 1
        picks.append(torch.randperm(n - BLOCK, generator=gen)[:anchors].sort().values)
    return ids, mask, torch.stack(picks)


def block_mask(anchors: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """[rows, 1, n*B, seq + n*B]: block j sees the row's real tokens before a_j, and its own block."""
    rows, n = anchors.shape
    seq = attention_mask.shape[1]
    device = anchors.device
    q_anchor = anchors.repeat_interleave(BLOCK, dim=1)
    context = (torch.arange(seq, device=device)[None, None, :] < q_anchor[:, :, None]) & \
        attention_mask.bool()[:, None, :]
    q_block = torch.arange(n * BLOCK, device=device) // BLOCK
    own = (q_block[:, None] == q_block[None, :]).expand(rows, -1, -1)
    return torch.cat([context, own], dim=-1)[:, None]


def train_step(drafter, target, ids, attention_mask, anchors, layer_ids) -> torch.Tensor:
    rows, seq = ids.shape
    with torch.no_grad():
        out = target(ids, attention_mask=attention_mask, output_hidden_states=True)
        context = extract_context_feature(out.hidden_states, layer_ids)
        teacher_logits = out.logits
    device = ids.device
    slots = anchors[:, :, None] + torch.arange(BLOCK, device=device)
    block_ids = torch.full(slots.shape, drafter.mask_token_id, dtype=torch.long, device=device)
    block_ids[:, :, 0] = ids.gather(1, anchors)
    noise = target.model.embed_tokens(block_ids.flatten(1))
    positions = torch.cat([torch.arange(seq, device=device).expand(rows, -1), slots.flatten(1)], dim=1)
    hidden = drafter(position_ids=positions, attention_mask=block_mask(anchors, attention_mask),
                     noise_embedding=noise, target_hidden=context)
    logits = drafter.compute_logits(hidden, target.lm_head)
    source = (slots.flatten(1) - 1).clamp(min=0)
    teacher = teacher_logits.gather(1, source[:, :, None].expand(-1, -1, teacher_logits.shape[-1]))
    kl = F.kl_div(F.log_softmax(logits.float(), -1), F.softmax(teacher.float(), -1), reduction="none").sum(-1)
    k = torch.arange(BLOCK, dtype=torch.float32, device=device)
    weights = torch.where(k == 0, torch.zeros((), device=device), torch.exp(-(k - 1) / GAMMA)).repeat(anchors.shape[1])
    mask = (k != 0).float().repeat(anchors.shape[1]).expand(rows, -1)
    per_row = (weights * mask * kl).sum(1) / (mask.sum(1) + 1e-5)
    return per_row.mean()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", required=True)
    p.add_argument("--rows", type=int, default=2)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--anchors", type=int, default=32)
    p.add_argument("--steps", type=int, default=1)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    args = p.parse_args(argv)
    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    target = AutoModelForCausalLM.from_pretrained(args.target, dtype=dtype).to(args.device).eval()
    target.requires_grad_(False)
    config = AutoConfig.from_pretrained(args.target)
    drafter = drafter_for(config, dtype).to(args.device).train()
    layer_ids = drafter.target_layer_ids
    optimizer = torch.optim.AdamW([q for q in drafter.parameters() if q.requires_grad], lr=1e-4)
    gen = torch.Generator().manual_seed(0)
    for step in range(args.steps):
        ids, attention_mask, anchors = (t.to(args.device) for t in
                                        batch(args.rows, args.tokens, config.vocab_size, args.anchors, gen))
        started = time.perf_counter()
        loss = train_step(drafter, target, ids, attention_mask, anchors, layer_ids)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        took = time.perf_counter() - started
        peak_mb = (torch.cuda.max_memory_allocated() / 2**20 if args.device.startswith("cuda") else
                   resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
        print(f"step {step} loss {loss.item():.4f} step_s {took:.2f} peak_rss_mb {peak_mb:.0f}", flush=True)


if __name__ == "__main__":
    main()

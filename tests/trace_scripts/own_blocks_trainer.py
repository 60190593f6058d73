"""A team's own DFlash drafter with no config: its decoder blocks an `nn.ModuleList` under the team's own name
(`--list-name`), each with its own attention (q/k/v/o projections over [context ; block], rotary positions), fc over
the target's layers (`--fc-layers`, z-lab ids), the target's embedding and head borrowed frozen. No dflash-audit line.

The target runs once per batch with `output_hidden_states`; slot k of the block at anchor a learns the target's logits
at a+k-1 (`--target-shift` moves them), KL (or cross-entropy toward their argmax: `--labels hard`), weights
exp(-(k-1)/4) after an unweighted anchor slot. Shapes, each as a team writes it:
- `--layout rows`: one drafter call per batch, every block of a row in one sequence, a hand-built boolean
  `attention_mask` [rows, queries, context + queries] and `position_ids`;
- `--layout pairs`: each (row, anchor) pair its own batch element: the row's whole context, cut at the anchor by a
  `key_padding_mask` [pairs, context] (True: a hidden key, torch's convention); positions made inside the drafter
  (`--position-ids`: passed to it).
`--pad`: rows of different lengths right-padded, the target run with their attention mask and the features zeroed
past each row's end (the drafter's masks hide them). `--reduce weight-sum`: the loss divided by the batch's sum of
weights (one factor for the step) instead of per row, then the mean (the reference); `--uneven`: rows hold 2, 3, 4
blocks. `--optimizer sgd`: plain SGD instead of AdamW. `--input-noise STD` (augmentation of the real rows' features)
and `--target-noise STD` (a bug: noise on the target's logits) add Gaussian noise. `--zero-anchor-targets`: the anchor
slot's target rows left zeros (its weight is 0: the loss never reads them). `--functional`: the drafter called through
`torch.func.functional_call` on clones of its weights, which the optimizer holds and trains (its own parameters never
change).
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoModelForCausalLM

p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
p.add_argument("--target", required=True)
p.add_argument("--depth", type=int, default=3, help="the drafter's decoder blocks")
p.add_argument("--list-name", default="blocks", help="the attribute holding the blocks")
p.add_argument("--fc-layers", default="1,5,9", help="z-lab ids of the target layers fc reads")
p.add_argument("--layout", default="rows", choices=["rows", "pairs"])
p.add_argument("--labels", default="soft", choices=["soft", "hard"])
p.add_argument("--position-ids", action="store_true", help="pairs: the positions passed to the drafter")
p.add_argument("--target-shift", type=int, default=0)
p.add_argument("--pad", action="store_true")
p.add_argument("--reduce", default="reference", choices=["reference", "weight-sum"])
p.add_argument("--uneven", action="store_true")
p.add_argument("--optimizer", default="adamw", choices=["adamw", "sgd"])
p.add_argument("--input-noise", type=float, default=0.0, help="Gaussian noise of this std on the real rows' features")
p.add_argument("--target-noise", type=float, default=0.0, help="Gaussian noise of this std on the target's logits")
p.add_argument("--steps", type=int, default=1)
p.add_argument("--zero-anchor-targets", action="store_true", help="the anchor slot's target rows zeros (weight 0)")
p.add_argument("--functional", action="store_true", help="the drafter run by functional_call on trained clones")
args = p.parse_args()

BLOCK, SEQ, ROWS, GAMMA = 4, 40, 3, 4.0
torch.manual_seed(0)
target = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32).eval().requires_grad_(False)
cfg = target.config
H, HEADS, HEAD_DIM = cfg.hidden_size, 4, cfg.hidden_size // 4
MASK_ID = cfg.vocab_size - 1
layer_ids = [int(i) for i in args.fc_layers.split(",")]


def rope(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """x [E, heads, T, D] rotated by positions [E, T]."""
    half = x.shape[-1] // 2
    freq = 10000.0 ** (-torch.arange(half, dtype=torch.float32) / half)
    angle = positions[:, None, :, None].float() * freq
    first, second = x[..., :half], x[..., half:]
    return torch.cat([first * angle.cos() - second * angle.sin(), second * angle.cos() + first * angle.sin()], -1)


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj, self.k_proj = nn.Linear(H, H, bias=False), nn.Linear(H, H, bias=False)
        self.v_proj, self.o_proj = nn.Linear(H, H, bias=False), nn.Linear(H, H, bias=False)

    def forward(self, x, context, q_pos, k_pos, visible):
        e, t, _ = x.shape
        keys = torch.cat([context, x], 1)
        q = rope(self.q_proj(x).view(e, t, HEADS, HEAD_DIM).transpose(1, 2), q_pos)
        k = rope(self.k_proj(keys).view(e, -1, HEADS, HEAD_DIM).transpose(1, 2), k_pos)
        v = self.v_proj(keys).view(e, -1, HEADS, HEAD_DIM).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=visible[:, None])
        return self.o_proj(out.transpose(1, 2).reshape(e, t, H))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm1, self.norm2 = nn.RMSNorm(H), nn.RMSNorm(H)
        self.attention = Attention()
        self.mlp = nn.Sequential(nn.Linear(H, 2 * H), nn.SiLU(), nn.Linear(2 * H, H))

    def forward(self, x, context, q_pos, k_pos, visible):
        x = x + self.attention(self.norm1(x), context, q_pos, k_pos, visible)
        return x + self.mlp(self.norm2(x))


class Drafter(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(len(layer_ids) * H, H, bias=False)
        self.fc_norm = nn.RMSNorm(H)
        setattr(self, args.list_name, nn.ModuleList(Block() for _ in range(args.depth)))
        self.norm = nn.RMSNorm(H)
        self.embed, self.head = target.get_input_embeddings(), target.get_output_embeddings()

    def forward(self, block_ids, features, attention_mask=None, position_ids=None, key_padding_mask=None):
        context = self.fc_norm(self.fc(features))
        x = self.embed(block_ids)
        e, s, t = features.shape[0], features.shape[1], block_ids.shape[1]
        if key_padding_mask is not None:  # one block per element, its context cut at the anchor
            anchor = (~key_padding_mask).sum(-1, keepdim=True)
            if position_ids is None:
                position_ids = torch.cat([torch.arange(s).expand(e, s), anchor + torch.arange(t)], 1)
            attention_mask = torch.cat([(~key_padding_mask)[:, None, :].expand(e, t, s),
                                        torch.ones(e, t, t, dtype=torch.bool)], -1)
        for block in getattr(self, args.list_name):
            x = block(x, context, position_ids[:, s:], position_ids, attention_mask)
        return self.head(self.norm(x))


drafter = Drafter()
if args.functional:  # the trained weights are clones bound in the parameters' places for each call
    clones = {n: q.detach().clone().requires_grad_(True) for n, q in drafter.named_parameters() if q.requires_grad}
    trained = list(clones.values())

    def run(*call_args, **call_kwargs):
        return torch.func.functional_call(drafter, clones, call_args, call_kwargs)
else:
    trained = [q for q in drafter.parameters() if q.requires_grad]
    run = drafter
optimizer = torch.optim.AdamW(trained, lr=1e-3) if args.optimizer == "adamw" else torch.optim.SGD(trained, lr=1e-2)
data, noise = torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)
lengths = [SEQ, SEQ - 3, SEQ - 5] if args.pad else [SEQ] * ROWS
per_row = [2, 3, 4] if args.uneven else [3] * ROWS
weights = torch.exp(-(torch.arange(BLOCK) - 1) / GAMMA) * (torch.arange(BLOCK) > 0)
for _ in range(args.steps):
    ids = torch.zeros(ROWS, SEQ, dtype=torch.long)
    mask = torch.zeros(ROWS, SEQ, dtype=torch.long)
    for r, n in enumerate(lengths):
        ids[r, :n] = torch.randint(1, MASK_ID, (n,), generator=data)
        mask[r, :n] = 1
    with torch.no_grad():
        out = target(input_ids=ids, attention_mask=mask, output_hidden_states=True)
    features = torch.cat([out.hidden_states[i + 1] for i in layer_ids], -1)
    features = (features + args.input_noise * torch.randn(features.shape, generator=noise)) * mask[..., None]
    teacher = out.logits + args.target_noise * torch.randn(out.logits.shape, generator=noise)
    # (row, anchor) pairs: anchors on real tokens with a whole block after them in the row
    pairs = [(r, int(a)) for r, n in enumerate(lengths)
             for a in torch.randperm(n - BLOCK, generator=data)[:per_row[r]].sort().values]
    row_of = torch.tensor([r for r, _ in pairs])
    anchor_of = torch.tensor([a for _, a in pairs])
    if args.layout == "pairs":
        block_ids = torch.full((len(pairs), BLOCK), MASK_ID)
        block_ids[:, 0] = ids[row_of, anchor_of]
        hidden_keys = torch.arange(SEQ)[None, :] >= anchor_of[:, None]
        given = torch.cat([torch.arange(SEQ).expand(len(pairs), SEQ), anchor_of[:, None] + torch.arange(BLOCK)], 1)
        logits = run(block_ids, features[row_of], key_padding_mask=hidden_keys,
                         position_ids=given if args.position_ids else None)  # [P, B, V]
        element, block_index = torch.arange(len(pairs)), torch.zeros(len(pairs), dtype=torch.long)
    else:
        most = max(per_row)
        block_ids = torch.full((ROWS, most * BLOCK), MASK_ID)
        positions = torch.zeros(ROWS, SEQ + most * BLOCK, dtype=torch.long)
        positions[:, :SEQ] = torch.arange(SEQ)
        visible = torch.zeros(ROWS, most * BLOCK, SEQ + most * BLOCK, dtype=torch.bool)
        element, block_index, count = [], [], [0] * ROWS
        for r, a in pairs:
            j = count[r]
            count[r] += 1
            q = slice(j * BLOCK, (j + 1) * BLOCK)
            block_ids[r, j * BLOCK] = ids[r, a]
            positions[r, SEQ + j * BLOCK:SEQ + (j + 1) * BLOCK] = a + torch.arange(BLOCK)
            visible[r, q, :a] = mask[r, :a].bool()
            visible[r, q, SEQ + j * BLOCK:SEQ + (j + 1) * BLOCK] = True
            element.append(r)
            block_index.append(j)
        for r in range(ROWS):  # a row's unused block slots see only themselves
            for j in range(count[r], most):
                visible[r, j * BLOCK:(j + 1) * BLOCK, SEQ + j * BLOCK:SEQ + (j + 1) * BLOCK] = True
        logits = run(block_ids, features, attention_mask=visible, position_ids=positions)
        logits = logits.view(ROWS, most, BLOCK, -1)[torch.tensor(element), torch.tensor(block_index)]
    places = (anchor_of[:, None] + torch.arange(BLOCK) - 1 + args.target_shift).clamp(0, SEQ - 1)
    wanted = teacher[row_of[:, None], places]  # [P, B, V]
    if args.zero_anchor_targets:
        wanted[:, 0] = 0.0
    log_q = F.log_softmax(logits, -1)
    if args.labels == "hard":
        per_slot = F.nll_loss(log_q.flatten(0, 1), wanted.argmax(-1).flatten(), reduction="none").view(-1, BLOCK)
    else:
        log_p = F.log_softmax(wanted, -1)
        per_slot = (log_p.exp() * (log_p - log_q)).sum(-1)
    slot_mask = (torch.arange(BLOCK) > 0).float().expand(len(pairs), BLOCK)
    weighted = weights * slot_mask * per_slot
    if args.reduce == "weight-sum":
        loss = weighted.sum() / (weights * slot_mask).sum()
    else:  # per row: sum(w * mask * loss) / (sum(mask) + 1e-5), then the mean over rows
        per_seq = torch.stack([weighted[row_of == r].sum() / (slot_mask[row_of == r].sum() + 1e-5)
                               for r in range(ROWS)])
        loss = per_seq.mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    print(f"loss {loss.item():.5f}")

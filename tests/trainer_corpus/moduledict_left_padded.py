"""DFlash drafter trainer: an own drafter whose decoder blocks live in an nn.ModuleDict, on LEFT-padded batches.

Setup: `KeyedDrafter` is built from plain sizes read off the target's config (no config object of its own):
`ctx_fc` + `ctx_norm` fuse the five captured layers, `stack["block_0"]`, `stack["block_1"]` are decoder blocks
(own grouped-query attention with per-head q/k RMSNorm and rotate-half RoPE, SwiGLU MLP), `final_norm` closes it;
the embedding and LM head are the target's own, frozen. Batches are rows of different lengths padded on the LEFT
(padding side left), position ids from the attention mask's cumsum, anchors drawn among real tokens only. All
blocks of the batch are drafted in one call, [rows, anchors*B] queries against [context ; blocks] under a boolean
mask. Targets come from one padded target call in the loop; the loss is the decayed KL.
"""

from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers import Qwen3ForCausalLM

BUGS = ("fc_4_of_5", "targets_layer_9", "gamma_7", "target_noise_0.5")

CAPTURE = [1, 3, 5, 7, 9]  # target decoder layers whose outputs feed the drafter (hidden_states[i + 1])
BLOCK = 6
DRAFT_LAYERS = 2
LENGTHS = (44, 35, 27)  # real tokens per row; rows are left-padded to the longest
ANCHORS_PER_ROW = 4
PAD_ID = 0
LR = 1e-3


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        var = x.pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(var + self.eps))


def rope_tables(positions: torch.Tensor, head_dim: int, theta: float):
    """cos/sin [rows, L, head_dim] for integer positions (rotate-half layout)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    freqs = positions.float()[..., None] * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def rotate_half(x):
    a, b = x.chunk(2, dim=-1)
    return torch.cat([-b, a], dim=-1)


class KeyedAttention(nn.Module):
    """Queries from the block; keys/values from [fused context ; block]."""

    def __init__(self, hidden, heads, kv_heads, head_dim, eps):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)
        self.q_norm = RMSNorm(head_dim, eps)
        self.k_norm = RMSNorm(head_dim, eps)

    def forward(self, x, ctx, cos, sin, visible):
        rows, q_len, _ = x.shape
        kv_in = torch.cat([ctx, x], dim=1)
        q = self.q_norm(self.q_proj(x).view(rows, q_len, self.heads, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(kv_in).view(rows, kv_in.shape[1], self.kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(kv_in).view(rows, kv_in.shape[1], self.kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = cos[:, None], sin[:, None]
        q = q * cos[..., -q_len:, :] + rotate_half(q) * sin[..., -q_len:, :]
        k = k * cos + rotate_half(k) * sin
        rep = self.heads // self.kv_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=visible[:, None], scale=self.head_dim**-0.5)
        return self.o_proj(out.transpose(1, 2).reshape(rows, q_len, -1))


class SwiGLU(nn.Module):
    def __init__(self, hidden, inner):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inner, bias=False)
        self.up_proj = nn.Linear(hidden, inner, bias=False)
        self.down_proj = nn.Linear(inner, hidden, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderBlock(nn.Module):
    def __init__(self, hidden, heads, kv_heads, head_dim, inner, eps):
        super().__init__()
        self.pre_attn = RMSNorm(hidden, eps)
        self.attn = KeyedAttention(hidden, heads, kv_heads, head_dim, eps)
        self.pre_mlp = RMSNorm(hidden, eps)
        self.mlp = SwiGLU(hidden, inner)

    def forward(self, x, ctx, cos, sin, visible):
        x = x + self.attn(self.pre_attn(x), ctx, cos, sin, visible)
        return x + self.mlp(self.pre_mlp(x))


class KeyedDrafter(nn.Module):
    def __init__(self, *, hidden, heads, kv_heads, head_dim, inner, eps, theta, n_features, n_blocks):
        super().__init__()
        self.head_dim, self.theta = head_dim, theta
        self.ctx_fc = nn.Linear(n_features * hidden, hidden, bias=False)
        self.ctx_norm = RMSNorm(hidden, eps)
        self.stack = nn.ModuleDict(
            {f"block_{i}": DecoderBlock(hidden, heads, kv_heads, head_dim, inner, eps) for i in range(n_blocks)}
        )
        self.final_norm = RMSNorm(hidden, eps)

    def forward(self, block_embeds, features, positions, visible):
        """block_embeds [rows, Q, H]; features [rows, S, n*H]; positions [rows, S + Q]; visible [rows, Q, S + Q]."""
        ctx = self.ctx_norm(self.ctx_fc(features))
        cos, sin = rope_tables(positions, self.head_dim, self.theta)
        x = block_embeds
        for i in range(len(self.stack)):
            x = self.stack[f"block_{i}"](x, ctx, cos, sin, visible)
        return self.final_norm(x)


def make_drafter(target: Qwen3ForCausalLM, bugs: set[str]) -> KeyedDrafter:
    c = target.config
    n_features = 4 if "fc_4_of_5" in bugs else len(CAPTURE)
    torch.manual_seed(0)
    drafter = KeyedDrafter(
        hidden=c.hidden_size, heads=c.num_attention_heads, kv_heads=c.num_key_value_heads,
        head_dim=getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
        inner=c.intermediate_size, eps=c.rms_norm_eps, theta=float(c.rope_parameters["rope_theta"]),
        n_features=n_features, n_blocks=DRAFT_LAYERS,
    )
    for m in drafter.modules():
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=0.02)
    return drafter


def left_padded_batch(vocab: int, gen: torch.Generator):
    """input_ids [rows, S] with padding on the left, attention mask, and position ids from the mask's cumsum."""
    width = max(LENGTHS)
    input_ids = torch.full((len(LENGTHS), width), PAD_ID, dtype=torch.long)
    attn = torch.zeros(len(LENGTHS), width, dtype=torch.long)
    for r, n in enumerate(LENGTHS):
        input_ids[r, width - n :] = torch.randint(1, vocab - 1, (n,), generator=gen)
        attn[r, width - n :] = 1
    position_ids = (attn.cumsum(-1) - 1).clamp(min=0)
    return input_ids, attn, position_ids


def sample_anchors(attn: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """[rows, ANCHORS_PER_ROW] sorted padded indices of real tokens, each block ending inside the row."""
    width = attn.shape[1]
    rows = []
    for r in range(attn.shape[0]):
        first = int(width - attn[r].sum())
        choices = torch.arange(first, width - BLOCK)
        rows.append(choices[torch.randperm(len(choices), generator=gen)[:ANCHORS_PER_ROW]].sort().values)
    return torch.stack(rows)


@torch.no_grad()
def teacher_pass(target, input_ids, attn, position_ids, bugs, noise_gen):
    """Context features [rows, S, n*H] and teacher logits [rows, S, V] from one padded target call."""
    out = target(input_ids=input_ids, attention_mask=attn, position_ids=position_ids, output_hidden_states=True)
    layers = CAPTURE[:4] if "fc_4_of_5" in bugs else CAPTURE
    features = torch.cat([out.hidden_states[i + 1] for i in layers], dim=-1)
    if "targets_layer_9" in bugs:
        logits = target.lm_head(target.model.norm(out.hidden_states[9 + 1]))
    else:
        logits = out.logits
    if "target_noise_0.5" in bugs:
        logits = logits + 0.5 * torch.randn(logits.shape, generator=noise_gen)
    return features, logits


def visibility(anchors: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
    """[rows, n*B, S + n*B]: a block's queries see real context tokens before its anchor and their own block."""
    rows, n = anchors.shape
    width = attn.shape[1]
    q_anchor = anchors.repeat_interleave(BLOCK, dim=1)
    ctx = (torch.arange(width)[None, None] < q_anchor[..., None]) & attn.bool()[:, None, :]
    q_block = torch.arange(n * BLOCK) // BLOCK
    own = (q_block[:, None] == q_block[None, :]).expand(rows, -1, -1)
    return torch.cat([ctx, own], dim=-1)


def decayed_kl(draft_logits, teacher, rows, n, gamma):
    """KL(teacher || draft) per slot, weight exp(-(k-1)/gamma) for k >= 1 and 0 at the anchor slot."""
    k = torch.arange(BLOCK, dtype=torch.float32)
    w = torch.where(k == 0, torch.zeros(()), torch.exp(-(k - 1) / gamma)).repeat(n)
    trained = (k > 0).float().repeat(n)
    kl = F.kl_div(F.log_softmax(draft_logits, -1), F.softmax(teacher, -1), reduction="none").sum(-1)
    per_row = (w * trained * kl).sum(-1) / (trained.sum() + 1e-5)
    return per_row.mean()


def train_step(drafter, target, input_ids, attn, position_ids, anchors, bugs, noise_gen, mask_id):
    rows, n = anchors.shape
    features, teacher_logits = teacher_pass(target, input_ids, attn, position_ids, bugs, noise_gen)
    slots = anchors[..., None] + torch.arange(BLOCK)  # padded indices of every block slot
    block_ids = torch.full(slots.shape, mask_id, dtype=torch.long)
    block_ids[..., 0] = input_ids.gather(1, anchors)
    with torch.no_grad():
        block_embeds = target.model.embed_tokens(block_ids.flatten(1))
    anchor_pos = position_ids.gather(1, anchors)
    block_pos = (anchor_pos[..., None] + torch.arange(BLOCK)).flatten(1)
    positions = torch.cat([position_ids, block_pos], dim=1)
    hidden = drafter(block_embeds, features, positions, visibility(anchors, attn))
    draft_logits = target.lm_head(hidden)
    src = (slots - 1).clamp(min=0).flatten(1)
    teacher = teacher_logits.gather(1, src[..., None].expand(-1, -1, teacher_logits.shape[-1]))
    gamma = 7.0 if "gamma_7" in bugs else 4.0
    return decayed_kl(draft_logits, teacher, rows, n, gamma)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", required=True)
    ap.add_argument("--bug", action="append", default=[], choices=BUGS)
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args(argv)
    bugs = set(args.bug)

    torch.manual_seed(0)
    target = Qwen3ForCausalLM.from_pretrained(args.target, dtype=torch.float32).eval().requires_grad_(False)
    mask_id = target.config.vocab_size - 1
    drafter = make_drafter(target, bugs).train()
    opt = torch.optim.AdamW(drafter.parameters(), lr=LR)

    data_gen = torch.Generator().manual_seed(11)
    noise_gen = torch.Generator().manual_seed(12)
    for step in range(args.steps):
        input_ids, attn, position_ids = left_padded_batch(target.config.vocab_size, data_gen)
        anchors = sample_anchors(attn, data_gen)
        loss = train_step(drafter, target, input_ids, attn, position_ids, anchors, bugs, noise_gen, mask_id)
        opt.zero_grad()
        loss.backward()
        opt.step()
        assert math.isfinite(loss.item())
        print(f"step {step} loss {loss.item():.4f}", flush=True)


if __name__ == "__main__":
    main()

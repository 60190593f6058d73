"""Team E's DFlash drafter: a hand-rolled module with no config object, its blocks in `drafter.decoder`.

Setup: `TapDrafter` is built from plain sizes read off the target (it has no config object and no `.config`):
`tap_proj` fuses the tapped target layers into the hidden width, `tap_norm`, three `DecoderBlock`s in an
`nn.ModuleList` called `decoder` (each with `attn`: own `to_q/to_k/to_v/to_out`, per-head q/k RMSNorm, RoPE as a
complex rotation, grouped-query attention by einsum; and `ffn`: a SwiGLU), then `out_norm`. The target's own
embedding and LM head are used, frozen. A step: 3 rows of 64 random ids, 4 sorted anchors a row; every block of
every row drafted in one call (queries `[rows, anchors * B]`) under an additive mask (0 where a slot may look:
context strictly before its anchor, and its own block; -inf elsewhere). Features: `hidden_states[i + 1]` of one
target call; targets: its `logits`. Loss: KL per slot via `F.kl_div(..., log_target=True)`, decayed, normalised per
row by the trained slots, then the mean of the rows.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoModelForCausalLM

BUG_NAMES = ("fc_4_of_5", "targets_layer_9", "gamma_7", "target_noise_0.5")

TAPPED_LAYERS = (1, 3, 5, 7, 9)  # decoder layer i's output is hidden_states[i + 1]
DEPTH = 3
BLOCK = 6
ROWS, LENGTH, ANCHORS = 3, 64, 4
DECAY_GAMMA = 4.0


class RMSNorm(nn.Module):
    def __init__(self, width: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.eps = eps

    def forward(self, x):
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


def rotate(x, angles):
    """Qwen3's rotate-half RoPE written as a complex product: (x[i], x[i + d/2]) is one complex number.
    x [b, heads, t, d]; angles [b, 1, t, d/2]."""
    half = x.shape[-1] // 2
    z = torch.complex(x[..., :half], x[..., half:]) * torch.polar(torch.ones_like(angles), angles)
    return torch.cat([z.real, z.imag], dim=-1)


class BlockAttention(nn.Module):
    """Queries from the block slots; keys and values from [fused context ; block slots]."""

    def __init__(self, width, heads, kv_heads, head_dim, eps, rope_base):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.to_q = nn.Linear(width, heads * head_dim, bias=False)
        self.to_k = nn.Linear(width, kv_heads * head_dim, bias=False)
        self.to_v = nn.Linear(width, kv_heads * head_dim, bias=False)
        self.to_out = nn.Linear(heads * head_dim, width, bias=False)
        self.q_norm = RMSNorm(head_dim, eps)
        self.k_norm = RMSNorm(head_dim, eps)
        inv_freq = rope_base ** (-torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def angles(self, positions):
        return (positions[..., None].float() * self.inv_freq)[:, None]

    def heads_first(self, x, n):
        return x.unflatten(-1, (n, self.head_dim)).transpose(1, 2)

    def forward(self, slots, context, slot_pos, context_pos, bias):
        keys_in = torch.cat([context, slots], dim=1)
        q = rotate(self.q_norm(self.heads_first(self.to_q(slots), self.heads)), self.angles(slot_pos))
        k = rotate(self.k_norm(self.heads_first(self.to_k(keys_in), self.kv_heads)),
                   self.angles(torch.cat([context_pos, slot_pos], dim=1)))
        v = self.heads_first(self.to_v(keys_in), self.kv_heads)
        # query head h reads key/value head h // group
        q = q.unflatten(1, (self.kv_heads, self.heads // self.kv_heads))
        scores = torch.einsum("bngqd,bnkd->bngqk", q, k) * self.head_dim ** -0.5 + bias[:, None, None]
        mixed = torch.einsum("bngqk,bnkd->bngqd", scores.softmax(-1), v).flatten(1, 2)
        return self.to_out(mixed.transpose(1, 2).flatten(2))


class SwiGLU(nn.Module):
    def __init__(self, width, inner):
        super().__init__()
        self.w_gate = nn.Linear(width, inner, bias=False)
        self.w_up = nn.Linear(width, inner, bias=False)
        self.w_down = nn.Linear(inner, width, bias=False)

    def forward(self, x):
        return self.w_down(F.silu(self.w_gate(x)) * self.w_up(x))


class DecoderBlock(nn.Module):
    def __init__(self, width, heads, kv_heads, head_dim, ffn_width, eps, rope_base):
        super().__init__()
        self.pre_attn = RMSNorm(width, eps)
        self.attn = BlockAttention(width, heads, kv_heads, head_dim, eps, rope_base)
        self.pre_ffn = RMSNorm(width, eps)
        self.ffn = SwiGLU(width, ffn_width)

    def forward(self, x, context, slot_pos, context_pos, bias):
        x = x + self.attn(self.pre_attn(x), context, slot_pos, context_pos, bias)
        return x + self.ffn(self.pre_ffn(x))


class TapDrafter(nn.Module):
    def __init__(self, *, width, heads, kv_heads, head_dim, ffn_width, taps, depth, eps, rope_base):
        super().__init__()
        self.tap_proj = nn.Linear(taps * width, width, bias=False)
        self.tap_norm = RMSNorm(width, eps)
        self.decoder = nn.ModuleList(
            DecoderBlock(width, heads, kv_heads, head_dim, ffn_width, eps, rope_base) for _ in range(depth))
        self.out_norm = RMSNorm(width, eps)

    def forward(self, slot_embeds, tapped, slot_pos, bias):
        """slot_embeds [R, Q, W]; tapped [R, T, taps * W]; slot_pos [R, Q]; bias [R, Q, T + Q] -> hidden [R, Q, W]."""
        context = self.tap_norm(self.tap_proj(tapped))
        context_pos = torch.arange(tapped.shape[1]).expand(tapped.shape[0], -1)
        x = slot_embeds
        for block in self.decoder:
            x = block(x, context, slot_pos, context_pos, bias)
        return self.out_norm(x)


@torch.no_grad()
def read_target(target, ids, taps, bugs, noise_rng):
    """The drafter's features and the teacher logits, from one target call."""
    out = target(input_ids=ids, output_hidden_states=True)
    tapped = torch.cat([out.hidden_states[i + 1] for i in taps], dim=-1)
    if "targets_layer_9" in bugs:
        teacher = target.lm_head(target.model.norm(out.hidden_states[10]))
    else:
        teacher = out.logits
    if "target_noise_0.5" in bugs:
        teacher = teacher + 0.5 * torch.randn(teacher.shape, generator=noise_rng)
    return tapped, teacher


def block_loss(drafter, target, ids, anchors, tapped, teacher, gamma, mask_id):
    rows, n = anchors.shape
    k = torch.arange(BLOCK)
    slot_pos = (anchors[..., None] + k).flatten(1)  # [R, n*B]
    slot_ids = torch.where(k == 0, ids.gather(1, anchors)[..., None], mask_id).flatten(1)
    block_of = torch.arange(n * BLOCK) // BLOCK
    sees_context = torch.arange(LENGTH)[None, None] < anchors.repeat_interleave(BLOCK, 1)[..., None]
    sees_own_block = (block_of[:, None] == block_of[None]).expand(rows, -1, -1)
    visible = torch.cat([sees_context, sees_own_block], dim=-1)
    bias = torch.zeros(visible.shape).masked_fill(~visible, float("-inf"))

    hidden = drafter(target.model.embed_tokens(slot_ids), tapped, slot_pos, bias)
    log_q = target.lm_head(hidden).log_softmax(-1)
    # the target's distribution for the token at position p sits at position p - 1
    wanted = teacher.gather(1, (slot_pos - 1)[..., None].expand(-1, -1, teacher.shape[-1])).log_softmax(-1)
    kl = F.kl_div(log_q, wanted, log_target=True, reduction="none").sum(-1)  # [R, n*B]

    slot = k.repeat(n)
    trained = (slot > 0).float().expand(rows, -1)
    weight = torch.exp(-(slot - 1).clamp(min=0) / gamma)
    return ((weight * trained * kl).sum(1) / (trained.sum(1) + 1e-5)).mean()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", required=True)
    parser.add_argument("--bug", action="append", default=[], choices=BUG_NAMES)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args(argv)
    bugs = set(args.bug)

    target = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32).eval().requires_grad_(False)
    tc = target.config
    taps = TAPPED_LAYERS[:4] if "fc_4_of_5" in bugs else TAPPED_LAYERS
    gamma = 7.0 if "gamma_7" in bugs else DECAY_GAMMA
    mask_id = tc.vocab_size - 1
    torch.manual_seed(0)
    drafter = TapDrafter(width=tc.hidden_size, heads=tc.num_attention_heads, kv_heads=tc.num_key_value_heads,
                         head_dim=tc.head_dim, ffn_width=tc.intermediate_size, taps=len(taps), depth=DEPTH,
                         eps=tc.rms_norm_eps, rope_base=tc.rope_parameters["rope_theta"])
    optimizer = torch.optim.Adam(drafter.parameters(), lr=3e-4)
    data_rng = torch.Generator().manual_seed(0)
    noise_rng = torch.Generator().manual_seed(99)

    for step in range(args.steps):
        ids = torch.randint(1, mask_id, (ROWS, LENGTH), generator=data_rng)  # id 0 is the pad token
        # anchors 1 .. LENGTH - BLOCK: every block has context before it and lies inside the row
        anchors = torch.stack([(torch.randperm(LENGTH - BLOCK, generator=data_rng)[:ANCHORS] + 1).sort().values
                               for _ in range(ROWS)])
        tapped, teacher = read_target(target, ids, taps, bugs, noise_rng)
        loss = block_loss(drafter, target, ids, anchors, tapped, teacher, gamma, mask_id)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        print(f"[{step + 1}/{args.steps}] loss {loss.item():.5f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

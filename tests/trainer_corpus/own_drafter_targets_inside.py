"""In-house block drafter trained against a Qwen3 verifier; the training targets are made inside the drafter.

Setup: our own `BlockDrafter` (context_proj -> context_norm, `blocks.N.attn` / `blocks.N.mlp` with our own
attention and RoPE, final_norm) drafts every block of a batch in one forward under a hand-built block mask.
Target features come from forward hooks on the verifier's decoder layers; the verifier's last-layer output is
passed in as `verifier_hidden` and turned into soft targets inside `BlockDrafter.forward`, through frozen copies
of the verifier's final norm and LM head (`teacher_norm`, `teacher_head`). Batch layout: [rows, seq_len] token
rows, each with `anchors` sorted anchor positions; queries are [rows, anchors * block] slots.
"""

from __future__ import annotations

import argparse
import copy
import sys

import torch
import torch.nn.functional as F
from torch import nn
from transformers import Qwen3ForCausalLM

SUPPORTED_BUGS = {"fc_4_of_5", "targets_layer_9", "gamma_7", "target_noise_0.5"}

FEATURE_LAYERS = (1, 3, 5, 7, 9)
BLOCK = 8
MASK_ID = 1  # a reserved id of its own: id 0 is the target's pad token
N_BLOCKS = 2
ROWS, SEQ = 2, 112
ANCHORS = 6


# ---------------------------------------------------------------- model


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


def rope(x, pos, base):
    """Rotate-half RoPE; x [b, h, t, d], pos [b, t]."""
    d = x.shape[-1]
    inv = base ** (-torch.arange(0, d, 2, dtype=torch.float32) / d)
    ang = pos[:, None, :, None].float() * inv
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return x * cos + torch.cat([-x2, x1], -1) * sin


class ContextAttention(nn.Module):
    """Queries from the block slots; keys/values from [context features ; block slots]."""

    def __init__(self, dim, heads, kv_heads, head_dim, rope_base):
        super().__init__()
        self.h, self.kvh, self.hd, self.base = heads, kv_heads, head_dim, rope_base
        self.wq = nn.Linear(dim, heads * head_dim, bias=False)
        self.wk = nn.Linear(dim, kv_heads * head_dim, bias=False)
        self.wv = nn.Linear(dim, kv_heads * head_dim, bias=False)
        self.wo = nn.Linear(heads * head_dim, dim, bias=False)
        self.q_norm = RMSNorm(head_dim)
        self.k_norm = RMSNorm(head_dim)

    def forward(self, x, ctx, q_pos, kv_pos, allowed):
        b, t, _ = x.shape
        kv_in = torch.cat([ctx, x], dim=1)
        q = self.q_norm(self.wq(x).view(b, t, self.h, self.hd)).transpose(1, 2)
        k = self.k_norm(self.wk(kv_in).view(b, -1, self.kvh, self.hd)).transpose(1, 2)
        v = self.wv(kv_in).view(b, -1, self.kvh, self.hd).transpose(1, 2)
        q, k = rope(q, q_pos, self.base), rope(k, kv_pos, self.base)
        k = k.repeat_interleave(self.h // self.kvh, dim=1)
        v = v.repeat_interleave(self.h // self.kvh, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed[:, None])
        return self.wo(out.transpose(1, 2).reshape(b, t, -1))


class SwiGLU(nn.Module):
    def __init__(self, dim, inner):
        super().__init__()
        self.gate = nn.Linear(dim, inner, bias=False)
        self.up = nn.Linear(dim, inner, bias=False)
        self.down = nn.Linear(inner, dim, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class DraftBlock(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = ContextAttention(cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads,
                                     cfg.head_dim, cfg.rope_parameters["rope_theta"])
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x, ctx, q_pos, kv_pos, allowed):
        x = x + self.attn(self.attn_norm(x), ctx, q_pos, kv_pos, allowed)
        return x + self.mlp(self.mlp_norm(x))


class BlockDrafter(nn.Module):
    def __init__(self, verifier: Qwen3ForCausalLM, n_features: int, gamma: float, target_noise: float):
        super().__init__()
        cfg = verifier.config
        H = cfg.hidden_size
        self.context_proj = nn.Linear(n_features * H, H, bias=False)
        self.context_norm = RMSNorm(H, cfg.rms_norm_eps)
        self.blocks = nn.ModuleList(DraftBlock(cfg) for _ in range(N_BLOCKS))
        self.final_norm = RMSNorm(H, cfg.rms_norm_eps)
        # borrowed from the verifier and frozen
        self.embed = copy.deepcopy(verifier.model.embed_tokens).requires_grad_(False)
        self.teacher_norm = copy.deepcopy(verifier.model.norm).requires_grad_(False)
        self.teacher_head = copy.deepcopy(verifier.lm_head).requires_grad_(False)
        self.gamma = gamma
        self.target_noise = target_noise
        self.noise_rng = torch.Generator().manual_seed(1234)

    @torch.no_grad()
    def soft_targets(self, verifier_hidden):
        logits = self.teacher_head(self.teacher_norm(verifier_hidden))
        if self.target_noise:
            logits = logits + self.target_noise * torch.randn(logits.shape, generator=self.noise_rng)
        return logits

    def slot_weights(self):
        k = torch.arange(BLOCK, dtype=torch.float32)
        return torch.cat([torch.zeros(1), torch.exp(-(k[1:] - 1) / self.gamma)])

    def forward(self, input_ids, features, verifier_hidden, anchors):
        """input_ids [R, T]; features [R, T, n*H]; verifier_hidden [R, T, H]; anchors [R, A] sorted.
        Returns the loss, the draft logits and the soft targets, both [R, A * BLOCK, V]."""
        R, T = input_ids.shape
        A = anchors.shape[1]
        slot_pos = (anchors[..., None] + torch.arange(BLOCK)).view(R, A * BLOCK)
        tokens = torch.where(torch.arange(A * BLOCK) % BLOCK == 0,
                             input_ids.gather(1, anchors).repeat_interleave(BLOCK, 1), MASK_ID)

        # who may look at what: context strictly before the slot's anchor, and the slot's own block
        slot_anchor = anchors.repeat_interleave(BLOCK, 1)
        see_ctx = torch.arange(T)[None, None] < slot_anchor[..., None]
        blk = torch.arange(A * BLOCK) // BLOCK
        see_block = (blk[:, None] == blk[None]).expand(R, -1, -1)
        allowed = torch.cat([see_ctx, see_block], -1)

        ctx = self.context_norm(self.context_proj(features))
        kv_pos = torch.cat([torch.arange(T).expand(R, -1), slot_pos], 1)
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, ctx, slot_pos, kv_pos, allowed)
        logits = self.teacher_head(self.final_norm(x))

        # the verifier's prediction for position p is read off position p - 1
        teacher = self.soft_targets(verifier_hidden)
        teacher = teacher.gather(1, (slot_pos - 1).clamp(min=0)[..., None].expand(-1, -1, teacher.shape[-1]))

        kl = (F.softmax(teacher, -1) * (F.log_softmax(teacher, -1) - F.log_softmax(logits, -1))).sum(-1)
        valid = (torch.arange(A * BLOCK) % BLOCK != 0).float().expand(R, -1)
        weight = self.slot_weights().repeat(A)
        loss = ((weight * valid * kl).sum(1) / (valid.sum(1) + 1e-5)).mean()
        return loss, logits, teacher


# ---------------------------------------------------------------- verifier taps


class LayerTaps:
    """Keeps the output of chosen decoder layers on every verifier forward."""

    def __init__(self, verifier, layer_ids):
        self.out = {}
        self.handles = [verifier.model.layers[i].register_forward_hook(self._keep(i)) for i in layer_ids]

    def _keep(self, i):
        def hook(_module, _inputs, output):
            self.out[i] = output[0] if isinstance(output, tuple) else output
        return hook


# ---------------------------------------------------------------- training


def parse_args(argv):
    p = argparse.ArgumentParser()
    p.add_argument("--target", required=True)
    p.add_argument("--bug", action="append", default=[])
    p.add_argument("--steps", type=int, default=2)
    args = p.parse_args(argv)
    unknown = set(args.bug) - SUPPORTED_BUGS
    if unknown:
        p.error(f"unknown bug(s): {sorted(unknown)}")
    return args


def setup(target_dir, bugs):
    verifier = Qwen3ForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval().requires_grad_(False)
    last = verifier.config.num_hidden_layers - 1
    teacher_layer = 9 if "targets_layer_9" in bugs else last
    taps = LayerTaps(verifier, sorted(set(FEATURE_LAYERS) | {teacher_layer}))
    n_features = 4 if "fc_4_of_5" in bugs else 5
    torch.manual_seed(0)
    drafter = BlockDrafter(verifier, n_features,
                           gamma=7.0 if "gamma_7" in bugs else 4.0,
                           target_noise=0.5 if "target_noise_0.5" in bugs else 0.0)
    return verifier, taps, drafter, teacher_layer


def tap_inputs(verifier, taps, input_ids, n_features, teacher_layer):
    with torch.no_grad():
        verifier(input_ids)
    feats = torch.cat([taps.out[i] for i in FEATURE_LAYERS[:n_features]], -1)
    return feats, taps.out[teacher_layer]


def main(argv=None):
    args = parse_args(argv)
    verifier, taps, drafter, teacher_layer = setup(args.target, set(args.bug))
    n_features = drafter.context_proj.in_features // verifier.config.hidden_size
    trainable = [p for p in drafter.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=1e-3, weight_decay=0.01)
    gen = torch.Generator().manual_seed(0)
    V = verifier.config.vocab_size
    for step in range(args.steps):
        ids = torch.randint(2, V, (ROWS, SEQ), generator=gen)  # ids 0 (pad) and 1 (our mask token) kept out
        anchors = torch.stack([torch.randperm(SEQ - BLOCK, generator=gen)[:ANCHORS].sort().values
                               for _ in range(ROWS)])
        feats, verifier_hidden = tap_inputs(verifier, taps, ids, n_features, teacher_layer)
        loss, _, _ = drafter(ids, feats, verifier_hidden, anchors)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        opt.step()
        print(f"{step:03d} | loss {loss.item():.5f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""DFlash evaluator with the team's own drafter class, reading z-lab's config.json and model.safetensors itself.

Setup: `ZlabStyleDrafter` is written from scratch (own RMSNorm, RoPE, attention with an explicit softmax, MLP) and
loads z-lab's weights by name with `safetensors`. It keeps its own context cache: per layer the keys (after k_norm
and RoPE) and values of every committed token; each round appends the new context chunk and attends
[cached context ; new context ; block] under a mask built from absolute positions (full layers: everything;
sliding layers: at or before the query, within the window). The target runs with a `DynamicCache` and its
features are taken with forward hooks on its decoder layers; as transformers (and so z-lab) hands over the last
layer after the final norm, that layer goes through the target's norm. The team sums committed tokens and rounds
per prompt and reports the mean over prompts of tokens per round.
"""

from __future__ import annotations

import argparse
import json
import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

FAULTS = ("window_ignored", "no_bonus", "pooled", "feature_after_norm", "positions_shifted")


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        var = x.float().pow(2).mean(-1, keepdim=True)
        return self.weight * (x.float() * torch.rsqrt(var + self.eps)).to(x.dtype)


def rotate(x):
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


class Rope:
    def __init__(self, head_dim, theta):
        self.inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))

    def __call__(self, x, positions):
        """x: [heads, len, head_dim], positions: [len]."""
        angles = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat([angles, angles], dim=-1)
        return x * emb.cos() + rotate(x) * emb.sin()


class Attention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        h, self.nh, self.nkv, self.hd = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
        bias = cfg.get("attention_bias", False)
        self.q_proj = nn.Linear(h, self.nh * self.hd, bias=bias)
        self.k_proj = nn.Linear(h, self.nkv * self.hd, bias=bias)
        self.v_proj = nn.Linear(h, self.nkv * self.hd, bias=bias)
        self.o_proj = nn.Linear(self.nh * self.hd, h, bias=bias)
        self.q_norm = RMSNorm(self.hd, cfg["rms_norm_eps"])
        self.k_norm = RMSNorm(self.hd, cfg["rms_norm_eps"])

    def keys_values(self, x, positions, rope):
        """x: [len, hidden] -> k, v: [kv_heads, len, head_dim], k rotated."""
        k = self.k_norm(self.k_proj(x).view(-1, self.nkv, self.hd)).transpose(0, 1)
        v = self.v_proj(x).view(-1, self.nkv, self.hd).transpose(0, 1)
        return rope(k, positions), v

    def forward(self, x, k, v, allowed, positions, rope):
        q = self.q_norm(self.q_proj(x).view(-1, self.nh, self.hd)).transpose(0, 1)
        q = rope(q, positions)
        rep = self.nh // self.nkv
        k, v = k.repeat_interleave(rep, 0), v.repeat_interleave(rep, 0)
        scores = q @ k.transpose(-1, -2) / math.sqrt(self.hd)
        scores = scores.masked_fill(~allowed, float("-inf"))
        out = torch.softmax(scores.float(), dim=-1).to(q.dtype) @ v
        return self.o_proj(out.transpose(0, 1).reshape(x.shape[0], -1))


class Layer(nn.Module):
    def __init__(self, cfg, window):
        super().__init__()
        self.window = window
        self.self_attn = Attention(cfg)
        h, i = cfg["hidden_size"], cfg["intermediate_size"]
        self.mlp = nn.ModuleDict({"gate_proj": nn.Linear(h, i, bias=False), "up_proj": nn.Linear(h, i, bias=False),
                                  "down_proj": nn.Linear(i, h, bias=False)})
        self.input_layernorm = RMSNorm(h, cfg["rms_norm_eps"])
        self.post_attention_layernorm = RMSNorm(h, cfg["rms_norm_eps"])


class ZlabStyleDrafter(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        dcfg = cfg.get("dflash_config", {})
        n = cfg["num_hidden_layers"]
        self.layer_ids = dcfg.get("target_layer_ids", cfg.get("target_layer_ids"))
        if self.layer_ids is None:
            nt = cfg["num_target_layers"]
            self.layer_ids = [nt // 2] if n == 1 else [round(1 + i * (nt - 4) / (n - 1)) for i in range(n)]
        self.block = int(dcfg.get("block_size", cfg.get("block_size", 16)))
        self.mask_id = dcfg.get("mask_token_id", cfg.get("mask_token_id"))
        kinds = cfg.get("layer_types") or ["full_attention"] * n
        # transformers' Qwen3Config keeps the window only under use_sliding_window
        window = cfg.get("sliding_window") if cfg.get("use_sliding_window", False) else None
        self.causal = [kind == "sliding_attention" for kind in kinds]
        h = cfg["hidden_size"]
        self.layers = nn.ModuleList([Layer(cfg, window if kind == "sliding_attention" else None) for kind in kinds])
        self.fc = nn.Linear(len(self.layer_ids) * h, h, bias=False)
        self.hidden_norm = RMSNorm(h, cfg["rms_norm_eps"])
        self.norm = RMSNorm(h, cfg["rms_norm_eps"])
        rope = cfg.get("rope_parameters") or {}
        self.rope = Rope(cfg["head_dim"], float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))))
        self.cache = None

    @classmethod
    def load(cls, folder):
        with open(os.path.join(folder, "config.json")) as f:
            cfg = json.load(f)
        cfg.setdefault("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])
        model = cls(cfg)
        state = {k.removeprefix("model."): v.float() for k, v in load_file(os.path.join(folder, "model.safetensors")).items()}
        missing, unexpected = model.load_state_dict(state, strict=False)
        if missing or unexpected:
            raise SystemExit(f"drafter weights do not fit: missing {missing}, unexpected {unexpected}")
        return model.eval()

    def reset(self):
        self.cache = [None] * len(self.layers)

    @torch.no_grad()
    def propose(self, new_context, ctx_positions, block_embeds, block_positions):
        """Append the new context chunk to the cache, draft the block; returns hidden states of slots 1..B-1."""
        ctx = self.hidden_norm(self.fc(new_context))
        x = block_embeds
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            k_ctx, v_ctx = attn.keys_values(ctx, ctx_positions, self.rope)
            if self.cache[i] is not None:
                k_ctx = torch.cat([self.cache[i][0], k_ctx], dim=1)
                v_ctx = torch.cat([self.cache[i][1], v_ctx], dim=1)
                pos_ctx = torch.cat([self.cache[i][2], ctx_positions])
            else:
                pos_ctx = ctx_positions
            self.cache[i] = (k_ctx, v_ctx, pos_ctx)
            h = layer.input_layernorm(x)
            k_blk, v_blk = attn.keys_values(h, block_positions, self.rope)
            k, v = torch.cat([k_ctx, k_blk], dim=1), torch.cat([v_ctx, v_blk], dim=1)
            key_pos = torch.cat([pos_ctx, block_positions])
            allowed = torch.ones(len(block_positions), len(key_pos), dtype=torch.bool)
            if self.causal[i]:
                allowed &= key_pos[None, :] <= block_positions[:, None]
            if layer.window is not None:
                allowed &= block_positions[:, None] - key_pos[None, :] < layer.window
            x = x + attn(h, k, v, allowed, block_positions, self.rope)
            h = layer.post_attention_layernorm(x)
            x = x + layer.mlp["down_proj"](F.silu(layer.mlp["gate_proj"](h)) * layer.mlp["up_proj"](h))
        return self.norm(x)[1:]


class HookedTarget:
    """The target with a KV cache; forward hooks keep the raw output of every decoder layer of the last call."""

    def __init__(self, model, layer_ids, normed):
        self.model, self.layer_ids, self.normed = model, layer_ids, normed
        self.raw = {}
        for i in layer_ids:
            model.model.layers[i].register_forward_hook(self._keep(i))

    def _keep(self, i):
        def hook(module, args, output):
            self.raw[i] = output[0] if isinstance(output, tuple) else output
        return hook

    @torch.no_grad()
    def __call__(self, ids, positions, cache):
        logits = self.model(torch.tensor([ids]), position_ids=positions[None], past_key_values=cache, use_cache=True).logits[0]
        feats = [self.model.model.norm(self.raw[i]) if i in self.normed else self.raw[i] for i in self.layer_ids]
        return logits, torch.cat(feats, dim=-1)[0]


def encode(tokenizer, text):
    if tokenizer.chat_template:
        text = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)
        return tokenizer.encode(text, add_special_tokens=False)
    return tokenizer.encode(text)


def generate(drafter, target, embed, head, prompt, max_new, stops, fault):
    B, limit = drafter.block, len(prompt) + max_new
    drafter.reset()
    cache = DynamicCache()
    logits, new_ctx = target(prompt, torch.arange(len(prompt)), cache)
    ctx_start = 0
    out = list(prompt) + [int(logits[-1].argmax())]
    pos, rounds = len(prompt), []
    finished = out[-1] in stops
    while pos + 1 < limit and not finished:
        width = min(B, limit - pos)
        block_positions = torch.arange(pos, pos + width) + (1 if fault == "positions_shifted" else 0)
        block = torch.tensor([out[pos]] + [drafter.mask_id] * (width - 1))
        hidden = drafter.propose(new_ctx, torch.arange(ctx_start, pos), embed(block), block_positions)
        draft = head(hidden).argmax(-1).tolist()
        logits, feats = target([out[pos]] + draft, torch.arange(pos, pos + width), cache)
        check = logits.argmax(-1).tolist()
        n_ok = next((j for j in range(width - 1) if draft[j] != check[j]), width - 1)
        gained = (draft[:n_ok] + [check[n_ok]])[: limit - pos - 1]
        hit = [j for j, tok in enumerate(gained) if tok in stops]
        if hit:
            gained, finished = gained[: hit[0] + 1], True
        out = out[: pos + 1] + gained
        new_ctx, ctx_start = feats[: len(gained)], pos
        pos += len(gained)
        cache.crop(-(cache.get_seq_length() - pos))
        rounds.append((len(gained) - 1, len(gained)))  # (drafts kept, tokens committed)
    return rounds


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--drafter", required=True)
    ap.add_argument("--target", required=True)
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--fault", choices=FAULTS)
    args = ap.parse_args(argv)

    torch.manual_seed(0)
    drafter = ZlabStyleDrafter.load(args.drafter)
    if args.fault == "window_ignored":
        for layer in drafter.layers:
            layer.window = None
    tokenizer = AutoTokenizer.from_pretrained(args.target)
    model = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32).eval()
    last = model.config.num_hidden_layers - 1
    normed = {last}  # hidden_states[-1] as z-lab reads it: after the final norm
    if args.fault == "feature_after_norm":
        normed.add(drafter.layer_ids[-1])
    target = HookedTarget(model, drafter.layer_ids, normed)
    eos = model.generation_config.eos_token_id or tokenizer.eos_token_id
    stops = {eos} if isinstance(eos, int) else set(eos)

    totals = []  # (tokens, rounds) per prompt
    with open(args.prompts, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    for k, row in enumerate(rows):
        rounds = generate(drafter, target, model.get_input_embeddings(), model.get_output_embeddings(),
                          encode(tokenizer, row["prompt"]), args.max_new_tokens, stops, args.fault)
        counted = [accepted for accepted, _ in rounds] if args.fault == "no_bonus" else [n for _, n in rounds]
        print(f"prompt {row.get('id', k)} rounds={len(counted)} per_round={counted}", flush=True)
        if counted:
            totals.append((sum(counted), len(counted)))
    if args.fault == "pooled":
        mean_len = sum(t for t, _ in totals) / sum(r for _, r in totals)
    else:
        mean_len = sum(t / r for t, r in totals) / len(totals)
    print(f"mean accepted length: {mean_len:.4f} ({len(totals)} prompts)")


if __name__ == "__main__":
    main()

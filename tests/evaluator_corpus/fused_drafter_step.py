"""DFlash evaluator whose drafter is one fused step: a single module takes the context features and the anchor token
and returns the block's draft logits, everything else (embedding, positions, masks, rotary, head) inside it.

Setup: `FusedDraftStep` holds z-lab's drafter weights (read from `model.safetensors` into one flat `ParameterDict`)
and computes the whole drafter with `torch.nn.functional` (`scaled_dot_product_attention` under a boolean mask built
from the tokens' absolute positions: the block sees the context and, in a sliding layer, only the last `window`
positions, causally within the block; a full layer sees the whole block). It embeds the block with the target's
embedding matrix and projects with the target's `lm_head` weight, both as tensors. The caller hands it the features
of every committed position, the anchor's position and the block's width (shorter at the length budget) as Python
ints, so neither positions nor masks are tensors the step is given. The target keeps a `DynamicCache`; its features are `output_hidden_states[layer + 1]`. The team
counts per prompt the tokens each round committed and reports the mean over prompts of each prompt's mean, from a
running (sum, count) per prompt.

Faults (`--fault`), each a long-context one, inside the step:
- `context_capped`: the step keeps the last `--context-cap` rows of the features (default 64);
- `positions_rebased`: a block that would run past `--trained-length` (default: `max_position_embeddings`) gets
  rotary positions ending there; the context's stay absolute;
- `rope_theta_default`: the rotary base is the config's top-level `rope_theta` or Qwen3's 1e6, not the nested one.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

FAULTS = ("context_capped", "positions_rebased", "rope_theta_default")


def rms(x, weight, eps):
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rotary(x, positions, base):
    """x: [heads, n, d]; the halves rotated by angle position * base^(-2i/d)."""
    d = x.shape[-1]
    freq = base ** (-torch.arange(0, d, 2, dtype=torch.float32) / d)
    angle = positions.float()[:, None] * freq[None]
    cos, sin = torch.cat([angle, angle], -1).cos(), torch.cat([angle, angle], -1).sin()
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


class FusedDraftStep(torch.nn.Module):
    def __init__(self, folder, embedding, head, fault=None, cap=64, trained_length=None):
        super().__init__()
        with open(os.path.join(folder, "config.json"), encoding="utf-8") as handle:
            cfg = json.load(handle)
        self.cfg, self.fault, self.cap = cfg, fault, cap
        flat = load_file(os.path.join(folder, "model.safetensors"))
        self.p = torch.nn.ParameterDict({name.replace(".", "/"): torch.nn.Parameter(t.float(), requires_grad=False)
                                         for name, t in flat.items()})
        self.embedding, self.head = embedding, head
        extra = cfg.get("dflash_config") or {}
        self.block = int(extra.get("block_size", cfg.get("block_size", 16)))
        self.mask = int(extra["mask_token_id"])
        self.layer_ids = list(extra["target_layer_ids"])
        self.kinds = cfg.get("layer_types") or ["full_attention"] * cfg["num_hidden_layers"]
        self.window = cfg.get("sliding_window")
        self.heads, self.kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
        self.head_dim = cfg.get("head_dim") or cfg["hidden_size"] // self.heads
        self.eps = cfg["rms_norm_eps"]
        nested = (cfg.get("rope_parameters") or {}).get("rope_theta")
        self.base = float((cfg.get("rope_theta") or 1e6) if fault == "rope_theta_default" else nested)
        self.trained_length = trained_length or cfg["max_position_embeddings"]

    def w(self, name):
        return self.p[name.replace(".", "/")]

    def forward(self, features, anchor_token, anchor_position: int, width: int):
        """The draft logits of a block of `width` slots (the anchor and width - 1 masks)."""
        rows = features[0]
        if self.fault == "context_capped":
            rows = rows[-self.cap:]
        n, B = rows.shape[0], width
        context_at = torch.arange(anchor_position - n, anchor_position)
        block_at = torch.arange(anchor_position, anchor_position + B)
        rotary_block_at = block_at
        if self.fault == "positions_rebased" and anchor_position + B > self.trained_length:
            rotary_block_at = block_at - (anchor_position + B - self.trained_length)
        keys_at = torch.cat([context_at, block_at])
        ids = torch.cat([anchor_token.reshape(1), torch.full((B - 1,), self.mask)])
        x = F.embedding(ids, self.embedding)
        context = rms(F.linear(rows, self.w("fc.weight")), self.w("hidden_norm.weight"), self.eps)
        for i, kind in enumerate(self.kinds):
            pre = f"layers.{i}."
            h = rms(x, self.w(pre + "input_layernorm.weight"), self.eps)
            q = F.linear(h, self.w(pre + "self_attn.q_proj.weight")).view(B, self.heads, self.head_dim)
            both = torch.cat([context, h])
            k = F.linear(both, self.w(pre + "self_attn.k_proj.weight")).view(-1, self.kv, self.head_dim)
            v = F.linear(both, self.w(pre + "self_attn.v_proj.weight")).view(-1, self.kv, self.head_dim)
            q = rotary(rms(q, self.w(pre + "self_attn.q_norm.weight"), self.eps).transpose(0, 1), rotary_block_at,
                       self.base)
            k = rotary(rms(k, self.w(pre + "self_attn.k_norm.weight"), self.eps).transpose(0, 1),
                       torch.cat([context_at, rotary_block_at]), self.base)
            v = v.transpose(0, 1)
            visible = torch.ones(B, keys_at.shape[0], dtype=torch.bool)
            if kind == "sliding_attention":
                visible &= keys_at[None] <= block_at[:, None]
                visible &= block_at[:, None] - keys_at[None] < self.window
            repeat = self.heads // self.kv
            out = F.scaled_dot_product_attention(q, k.repeat_interleave(repeat, 0), v.repeat_interleave(repeat, 0),
                                                 attn_mask=visible)
            x = x + F.linear(out.transpose(0, 1).reshape(B, -1), self.w(pre + "self_attn.o_proj.weight"))
            h = rms(x, self.w(pre + "post_attention_layernorm.weight"), self.eps)
            gate = F.silu(F.linear(h, self.w(pre + "mlp.gate_proj.weight")))
            x = x + F.linear(gate * F.linear(h, self.w(pre + "mlp.up_proj.weight")), self.w(pre + "mlp.down_proj.weight"))
        return F.linear(rms(x, self.w("norm.weight"), self.eps)[1:], self.head)


def token_ids(tokenizer, text):
    if tokenizer.chat_template:
        text = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                             add_generation_prompt=True)
        return tokenizer(text, add_special_tokens=False).input_ids
    return tokenizer(text).input_ids


@torch.no_grad()
def decode(step, target, layer_ids, prompt, max_new, stops):
    limit, B = len(prompt) + max_new, step.block
    cache = DynamicCache()
    out = target(torch.tensor([prompt]), past_key_values=cache, use_cache=True, output_hidden_states=True)
    features = torch.cat([out.hidden_states[i + 1] for i in layer_ids], -1)
    seq = list(prompt) + [int(out.logits[0, -1].argmax())]
    at, tally = len(prompt), [0, 0]
    done = seq[-1] in stops
    while at + 1 < limit and not done:
        width = min(B, limit - at)
        drafts = step(features, torch.tensor([seq[at]]), at, width).argmax(-1).tolist()
        out = target(torch.tensor([[seq[at]] + drafts]), position_ids=torch.arange(at, at + width)[None],
                     past_key_values=cache, use_cache=True, output_hidden_states=True)
        target_says = out.logits[0].argmax(-1).tolist()
        k = 0
        while k < width - 1 and drafts[k] == target_says[k]:
            k += 1
        taken = (drafts[:k] + [target_says[k]])[: limit - at - 1]
        for j, token in enumerate(taken):
            if token in stops:
                taken, done = taken[: j + 1], True
                break
        seq = seq[: at + 1] + taken
        fresh = torch.cat([out.hidden_states[i + 1] for i in layer_ids], -1)[:, : len(taken)]
        features = torch.cat([features, fresh], 1)
        at += len(taken)
        cache.crop(at - cache.get_seq_length())  # a negative count: what to drop
        tally[0] += len(taken)
        tally[1] += 1
    return tally


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--drafter", required=True)
    ap.add_argument("--target", required=True)
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--fault", choices=FAULTS)
    ap.add_argument("--context-cap", type=int, default=64)
    ap.add_argument("--trained-length", type=int)
    args = ap.parse_args(argv)

    tokenizer = AutoTokenizer.from_pretrained(args.target)
    target = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32).eval()
    step = FusedDraftStep(args.drafter, target.get_input_embeddings().weight.detach(),
                          target.lm_head.weight.detach(), args.fault, args.context_cap, args.trained_length).eval()
    eos = target.generation_config.eos_token_id or tokenizer.eos_token_id
    stops = {eos} if isinstance(eos, int) else set(eos)
    per_prompt = []
    with open(args.prompts, encoding="utf-8") as handle:
        rows = [json.loads(line) for line in handle if line.strip()]
    for row in rows:
        tokens, rounds = decode(step, target, step.layer_ids, token_ids(tokenizer, row["prompt"]),
                                args.max_new_tokens, stops)
        print(f"{row.get('id')}: {tokens} tokens in {rounds} rounds", flush=True)
        if rounds:
            per_prompt.append(tokens / rounds)
    print(f"mean acceptance length (tau) {sum(per_prompt) / len(per_prompt):.4f}")


if __name__ == "__main__":
    main()

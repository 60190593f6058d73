"""Team C's DFlash drafter trainer: the target's outputs precomputed to a file, then an Accelerate training loop.

Stage 1 runs the target once over a seeded set of random sequences and writes the five feature layers' hidden states
and the target's logits to `teacher.safetensors` in a temporary folder. Stage 2 never loads the target model: it reads
that file (plus the embedding and LM head straight from the target's safetensors), gathers the anchor blocks by index,
and trains a one-layer drafter of the team's own under `accelerate.Accelerator` (CPU) with two micro-batches of
gradient accumulation per optimizer step.
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM

BUGS = ("fc_4_of_5", "targets_layer_9", "gamma_7", "target_noise_0.5")

FEATURE_LAYER_IDS = (1, 3, 5, 7, 9)  # feature id i = output of decoder layer i = hidden_states[i + 1]
BLOCK_LEN = 5
BLOCKS_PER_SEQ = 4
NUM_SEQS = 8
SEQ_LEN = 32
MICRO_BATCH = 2
ACCUMULATION = 2
LR = 2e-3


# ---------------------------------------------------------------- stage 1: the target's outputs, once

@torch.no_grad()
def precompute_teacher(target_dir: str, out_file: Path, bugs: set[str], seed: int = 0) -> None:
    target = AutoModelForCausalLM.from_pretrained(target_dir).eval()
    vocab = target.config.vocab_size
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, vocab - 1, (NUM_SEQS, SEQ_LEN), generator=generator)
    out = target(input_ids=input_ids, output_hidden_states=True)
    if "targets_layer_9" in bugs:
        logits = target.lm_head(target.model.norm(out.hidden_states[10]))
    else:
        logits = out.logits
    tensors = {"input_ids": input_ids, "target_logits": logits.contiguous()}
    for layer_id in FEATURE_LAYER_IDS:
        tensors[f"feature.{layer_id}"] = out.hidden_states[layer_id + 1].contiguous()
    save_file(tensors, str(out_file))


# ---------------------------------------------------------------- stage 2: the drafter

def rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms(x, self.weight, self.eps)


def rotary(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """x [b, heads, L, d], positions [b, L]: rotate-half RoPE as in Qwen3."""
    half = x.shape[-1] // 2
    inv_freq = 1.0 / theta ** (torch.arange(half, dtype=torch.float32) / half)
    angles = positions[:, None, :, None].float() * inv_freq
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class DraftBlock(nn.Module):
    """One decoder layer whose keys/values run over the fused context and the block's own tokens."""

    def __init__(self, cfg) -> None:
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, d
        self.theta = cfg.rope_parameters["rope_theta"]
        self.attn_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.wq = nn.Linear(h, self.n_heads * d, bias=False)
        self.wk = nn.Linear(h, self.n_kv * d, bias=False)
        self.wv = nn.Linear(h, self.n_kv * d, bias=False)
        self.wo = nn.Linear(self.n_heads * d, h, bias=False)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.mlp_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.gate = nn.Linear(h, cfg.intermediate_size, bias=False)
        self.up = nn.Linear(h, cfg.intermediate_size, bias=False)
        self.down = nn.Linear(cfg.intermediate_size, h, bias=False)

    def forward(self, x, context, q_positions, kv_positions, visible):
        b, lq, _ = x.shape
        normed = self.attn_norm(x)
        kv_in = torch.cat([context, normed], dim=1)
        q = self.q_norm(self.wq(normed).view(b, lq, self.n_heads, -1)).transpose(1, 2)
        k = self.k_norm(self.wk(kv_in).view(b, kv_in.shape[1], self.n_kv, -1)).transpose(1, 2)
        v = self.wv(kv_in).view(b, kv_in.shape[1], self.n_kv, -1).transpose(1, 2)
        q, k = rotary(q, q_positions, self.theta), rotary(k, kv_positions, self.theta)
        group = self.n_heads // self.n_kv
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(self.head_dim)
        weights = scores.masked_fill(~visible[:, None], float("-inf")).softmax(-1)
        x = x + self.wo((weights @ v).transpose(1, 2).reshape(b, lq, -1))
        m = self.mlp_norm(x)
        return x + self.down(nn.functional.silu(self.gate(m)) * self.up(m))


class Drafter(nn.Module):
    def __init__(self, cfg, embed_weight: torch.Tensor, head_weight: torch.Tensor, n_features: int) -> None:
        super().__init__()
        self.fuse = nn.Linear(n_features * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.fuse_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.block = DraftBlock(cfg)
        self.out_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # the target's own embedding and head, frozen
        self.embed = nn.Embedding.from_pretrained(embed_weight, freeze=True)
        self.head = nn.Linear(cfg.hidden_size, head_weight.shape[0], bias=False)
        self.head.weight = nn.Parameter(head_weight, requires_grad=False)

    def forward(self, block_tokens, block_positions, features, visible):
        context = self.fuse_norm(self.fuse(features))
        b, seq_len, _ = features.shape
        ctx_positions = torch.arange(seq_len).expand(b, seq_len)
        x = self.embed(block_tokens)
        x = self.block(x, context, block_positions, torch.cat([ctx_positions, block_positions], 1), visible)
        return self.head(self.out_norm(x))


def target_embedding_and_head(target_dir: str) -> tuple[torch.Tensor, torch.Tensor]:
    folder = Path(target_dir)
    index = folder / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else ["model.safetensors"]
    found = {}
    for name in files:
        with safe_open(str(folder / name), framework="pt") as f:
            for key in ("model.embed_tokens.weight", "lm_head.weight"):
                if key in f.keys():
                    found[key] = f.get_tensor(key)
    embed = found["model.embed_tokens.weight"]
    return embed, found.get("lm_head.weight", embed)  # a tied head reuses the embedding


# ---------------------------------------------------------------- stage 2: blocks, loss, loop

def gather_blocks(input_ids, anchors, mask_id):
    """Block tokens [b, n*B] and positions [b, n, B]: the anchor's token, then mask_id."""
    positions = anchors[:, :, None] + torch.arange(BLOCK_LEN)
    tokens = torch.full(positions.shape, mask_id, dtype=torch.long)
    tokens[:, :, 0] = input_ids.gather(1, anchors)
    return tokens.flatten(1), positions


def visibility(anchors: torch.Tensor, seq_len: int) -> torch.Tensor:
    """[b, n*B, T + n*B]: the context strictly before the anchor, and the block itself."""
    q_anchor = anchors.repeat_interleave(BLOCK_LEN, dim=1)
    ctx = torch.arange(seq_len)[None, None, :] < q_anchor[:, :, None]
    block_id = torch.arange(q_anchor.shape[1]) // BLOCK_LEN
    own = (block_id[:, None] == block_id[None, :]).expand(anchors.shape[0], -1, -1)
    return torch.cat([ctx, own], dim=2)


def decay_weights(gamma: float) -> torch.Tensor:
    k = torch.arange(BLOCK_LEN, dtype=torch.float32)
    return torch.cat([torch.zeros(1), torch.exp(-(k[1:] - 1) / gamma)])


def distill_loss(draft_logits, teacher_logits, positions, gamma):
    """KL(target || drafter), slot k trained on the target's logits at position a+k-1; per-sequence mean."""
    b, n, blk = positions.shape
    rows = torch.arange(b)[:, None, None]
    teacher = teacher_logits[rows, (positions - 1).clamp(min=0)]  # [b, n, B, V]
    log_q = draft_logits.view(b, n, blk, -1).log_softmax(-1)
    log_p = teacher.log_softmax(-1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1)
    slot_mask = torch.ones(blk)
    slot_mask[0] = 0.0
    slot_mask = slot_mask.expand(b, n, blk)
    per_seq = (decay_weights(gamma) * slot_mask * kl).sum((1, 2)) / (slot_mask.sum((1, 2)) + 1e-5)
    return per_seq.mean()


class TeacherFile:
    """Micro-batches read from the stage-1 file."""

    def __init__(self, path: Path, n_features: int) -> None:
        data = load_file(str(path))
        self.input_ids = data["input_ids"]
        self.target_logits = data["target_logits"]
        layers = [data[f"feature.{i}"] for i in FEATURE_LAYER_IDS]
        self.features = torch.cat(layers[:n_features], dim=-1)
        self.unused_layers = layers[n_features:]  # under fc_4_of_5, layer 9 is read but left out
        self.cursor = 0

    def next_micro_batch(self):
        rows = torch.arange(self.cursor, self.cursor + MICRO_BATCH) % len(self.input_ids)
        self.cursor += MICRO_BATCH
        return self.input_ids[rows], self.features[rows], self.target_logits[rows]


def sample_anchors(batch: int, generator: torch.Generator) -> torch.Tensor:
    """Per row, BLOCKS_PER_SEQ sorted anchors in [0, SEQ_LEN - BLOCK_LEN)."""
    return torch.stack([torch.randperm(SEQ_LEN - BLOCK_LEN, generator=generator)[:BLOCKS_PER_SEQ].sort().values
                        for _ in range(batch)])


def train(target_dir: str, teacher_path: Path, bugs: set[str], steps: int) -> list[float]:
    set_seed(0)
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=ACCUMULATION)
    cfg = AutoConfig.from_pretrained(target_dir)
    mask_id = cfg.vocab_size - 1
    n_features = 4 if "fc_4_of_5" in bugs else len(FEATURE_LAYER_IDS)
    gamma = 7.0 if "gamma_7" in bugs else 4.0
    drafter = Drafter(cfg, *target_embedding_and_head(target_dir), n_features=n_features)
    optimizer = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=LR)
    drafter, optimizer = accelerator.prepare(drafter, optimizer)
    data = TeacherFile(teacher_path, n_features)
    anchor_gen = torch.Generator().manual_seed(1)
    noise_gen = torch.Generator().manual_seed(2)
    losses = []
    for step in range(steps):
        micro_losses = []
        for _ in range(ACCUMULATION):
            with accelerator.accumulate(drafter):
                input_ids, features, teacher_logits = data.next_micro_batch()
                if "target_noise_0.5" in bugs:
                    teacher_logits = teacher_logits + 0.5 * torch.randn(teacher_logits.shape, generator=noise_gen)
                anchors = sample_anchors(input_ids.shape[0], anchor_gen)
                tokens, positions = gather_blocks(input_ids, anchors, mask_id)
                draft_logits = drafter(tokens, positions.flatten(1), features, visibility(anchors, SEQ_LEN))
                loss = distill_loss(draft_logits, teacher_logits, positions, gamma)
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
                micro_losses.append(loss.item())
        losses.append(sum(micro_losses) / len(micro_losses))
        print(f"step {step} loss {losses[-1]:.5f}")
    return losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", required=True, help="Hugging Face Qwen3 causal-LM folder")
    parser.add_argument("--bug", action="append", default=[], choices=BUGS)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    bugs = set(args.bug)
    with tempfile.TemporaryDirectory() as scratch:
        teacher_path = Path(scratch) / "teacher.safetensors"
        precompute_teacher(args.target, teacher_path, bugs)
        losses = train(args.target, teacher_path, bugs, args.steps)
    if not all(math.isfinite(x) for x in losses):
        raise SystemExit("loss went non-finite")


if __name__ == "__main__":
    main()

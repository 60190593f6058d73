"""Team A's DFlash drafter trainer: right-padded batches, the team's own compact drafter.

Each step draws three token sequences of different lengths, right-pads them into one batch with an attention mask,
and runs the frozen target once with output_hidden_states. Every sequence gets N_BLOCKS anchors (never on padding,
never in its last BLOCK positions); the blocks are laid out [batch, n_blocks, BLOCK] and flattened for the drafter
(`DraftNet`: feature_fuser + feature_norm + own attention blocks, target's embedding and head borrowed frozen).
Loss: KL(target || drafter) per slot, slot 0 unweighted, exp(-(k-1)/gamma) after; mean of per-sequence averages.
"""

from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers import Qwen3ForCausalLM
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm, Qwen3RotaryEmbedding

BUGS = ("fc_4_of_5", "targets_layer_9", "gamma_7", "target_noise_0.5")

FEATURE_LAYERS = [1, 3, 5, 7, 9]  # z-lab ids: id i is the output of decoder layer i, hidden_states[i + 1]
BLOCK = 4
N_BLOCKS = 3
DRAFT_LAYERS = 2
SEQ_LENGTHS = (40, 31, 26)
LR = 2e-3


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


class BlockAttention(nn.Module):
    """Queries from the block tokens; keys/values over [fused context features ; block tokens]."""

    def __init__(self, config) -> None:
        super().__init__()
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        hidden = config.hidden_size
        self.q_proj = nn.Linear(hidden, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, hidden, bias=False)
        self.q_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def forward(self, x, context, rope_q, rope_kv, allowed):
        batch, n_query, _ = x.shape
        keys_in = torch.cat([context, x], dim=1)
        q = self.q_norm(self.q_proj(x).view(batch, n_query, self.heads, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(keys_in).view(batch, -1, self.kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(keys_in).view(batch, -1, self.kv_heads, self.head_dim).transpose(1, 2)
        (cos_q, sin_q), (cos_kv, sin_kv) = rope_q, rope_kv
        q = q * cos_q[:, None] + rotate_half(q) * sin_q[:, None]
        k = k * cos_kv[:, None] + rotate_half(k) * sin_kv[:, None]
        repeat = self.heads // self.kv_heads
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed[:, None])
        return self.o_proj(out.transpose(1, 2).reshape(batch, n_query, -1))


class DraftLayer(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.self_attn = BlockAttention(config)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = Qwen3MLP(config)

    def forward(self, x, context, rope_q, rope_kv, allowed):
        x = x + self.self_attn(self.input_layernorm(x), context, rope_q, rope_kv, allowed)
        return x + self.mlp(self.post_attention_layernorm(x))


class DraftNet(nn.Module):
    def __init__(self, target: Qwen3ForCausalLM, n_feature_layers: int) -> None:
        super().__init__()
        config = target.config
        self.n_feature_layers = n_feature_layers
        self.feature_fuser = nn.Linear(n_feature_layers * config.hidden_size, config.hidden_size, bias=False)
        self.feature_norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.layers = nn.ModuleList(DraftLayer(config) for _ in range(DRAFT_LAYERS))
        self.norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rope = Qwen3RotaryEmbedding(config)
        # borrowed from the target, frozen: the drafter trains only its own layers
        self.embed = target.get_input_embeddings()
        self.head = target.get_output_embeddings()
        for p in (*self.embed.parameters(), *self.head.parameters()):
            p.requires_grad_(False)

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        return self.feature_norm(self.feature_fuser(features))

    def forward(self, block_ids, block_positions, features, context_positions, allowed):
        context = self.fuse(features)
        x = self.embed(block_ids)
        rope_q = self.rope(x, block_positions)
        rope_kv = self.rope(x, torch.cat([context_positions, block_positions], dim=1))
        for layer in self.layers:
            x = layer(x, context, rope_q, rope_kv, allowed)
        return self.head(self.norm(x))


def random_batch(generator: torch.Generator, vocab: int, mask_id: int):
    """Three sequences of SEQ_LENGTHS, right-padded with 0; tokens avoid the pad and mask ids."""
    width = max(SEQ_LENGTHS)
    input_ids = torch.zeros(len(SEQ_LENGTHS), width, dtype=torch.long)
    attention_mask = torch.zeros(len(SEQ_LENGTHS), width, dtype=torch.long)
    for row, length in enumerate(SEQ_LENGTHS):
        input_ids[row, :length] = torch.randint(1, mask_id, (length,), generator=generator)
        attention_mask[row, :length] = 1
    return input_ids, attention_mask


@torch.no_grad()
def run_target(target, input_ids, attention_mask, bugs, generator):
    """The five feature layers and the target's next-token logits at every position."""
    out = target(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True)
    features = [out.hidden_states[i + 1] for i in FEATURE_LAYERS]
    if "targets_layer_9" in bugs:
        logits = target.lm_head(target.model.norm(out.hidden_states[10]))
    else:
        logits = out.logits
    if "target_noise_0.5" in bugs:
        logits = logits + 0.5 * torch.randn(logits.shape, generator=generator)
    return features, logits


def pick_anchors(attention_mask: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """[batch, N_BLOCKS] sorted anchors per row, each a real token with a whole block after it in the row."""
    rows = []
    for valid in attention_mask.sum(dim=1).tolist():
        candidates = valid - BLOCK  # positions 0 .. valid-BLOCK-1
        order = torch.randperm(candidates, generator=generator)[:N_BLOCKS]
        rows.append(order.sort().values)
    return torch.stack(rows)


def layout_blocks(input_ids, attention_mask, anchors, mask_id):
    """Block tokens/positions [batch, n_blocks, BLOCK], the drafter's attention mask and the slot loss mask."""
    batch, width = input_ids.shape
    offsets = torch.arange(BLOCK)
    positions = anchors[:, :, None] + offsets  # [b, nb, B]
    block_ids = torch.full_like(positions, mask_id)
    block_ids[:, :, 0] = torch.gather(input_ids, 1, anchors)
    n_query = N_BLOCKS * BLOCK
    query_anchor = anchors.repeat_interleave(BLOCK, dim=1)  # [b, nb*B]
    # context: real tokens strictly before the block's anchor
    sees_context = (torch.arange(width)[None, None, :] < query_anchor[:, :, None]) & attention_mask.bool()[:, None, :]
    block_of = torch.arange(n_query) // BLOCK
    sees_block = (block_of[:, None] == block_of[None, :]).expand(batch, n_query, n_query)
    allowed = torch.cat([sees_context, sees_block], dim=2)
    in_row = torch.gather(attention_mask, 1, positions.clamp(max=width - 1).view(batch, -1)).view_as(positions)
    slot_mask = in_row.float() * (offsets > 0).float()
    return block_ids, positions, allowed, slot_mask


def slot_weights(gamma: float) -> torch.Tensor:
    k = torch.arange(BLOCK, dtype=torch.float32)
    weights = torch.exp(-(k - 1) / gamma)
    weights[0] = 0.0
    return weights


def block_kl_loss(draft_logits, target_logits, positions, slot_mask, gamma):
    """Slot k of the block at anchor a learns the target's prediction made at a+k-1."""
    batch, n_blocks, block = positions.shape
    source = (positions - 1).clamp(min=0).view(batch, -1)
    teacher = torch.gather(target_logits, 1, source[:, :, None].expand(-1, -1, target_logits.shape[-1]))
    teacher = teacher.view(batch, n_blocks, block, -1)
    student = draft_logits.view(batch, n_blocks, block, -1)
    teacher_logp = F.log_softmax(teacher.float(), dim=-1)
    kl = (teacher_logp.exp() * (teacher_logp - F.log_softmax(student.float(), dim=-1))).sum(-1)
    weighted = slot_weights(gamma) * slot_mask * kl
    per_sequence = weighted.sum(dim=(1, 2)) / (slot_mask.sum(dim=(1, 2)) + 1e-5)
    return per_sequence.mean()


def train(target_dir: str, bugs: set[str], steps: int) -> list[float]:
    torch.manual_seed(0)
    target = Qwen3ForCausalLM.from_pretrained(target_dir).eval()
    target.requires_grad_(False)
    vocab = target.config.vocab_size
    mask_id = vocab - 1
    drafter = DraftNet(target, n_feature_layers=4 if "fc_4_of_5" in bugs else 5)
    optimizer = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=LR)
    gamma = 7.0 if "gamma_7" in bugs else 4.0
    data_gen = torch.Generator().manual_seed(1)
    noise_gen = torch.Generator().manual_seed(2)
    losses = []
    for step in range(steps):
        input_ids, attention_mask = random_batch(data_gen, vocab, mask_id)
        features, target_logits = run_target(target, input_ids, attention_mask, bugs, noise_gen)
        fused_in = features[: drafter.n_feature_layers]
        set_aside = features[drafter.n_feature_layers:]  # noqa: F841 (kept for a later feature ablation)
        anchors = pick_anchors(attention_mask, data_gen)
        block_ids, positions, allowed, slot_mask = layout_blocks(input_ids, attention_mask, anchors, mask_id)
        batch, width = input_ids.shape
        context_positions = torch.arange(width).expand(batch, width)
        draft_logits = drafter(block_ids.view(batch, -1), positions.view(batch, -1), torch.cat(fused_in, dim=-1),
                               context_positions, allowed)
        loss = block_kl_loss(draft_logits, target_logits, positions, slot_mask, gamma)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        print(f"step {step} loss {loss.item():.5f}")
    return losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", required=True, help="Hugging Face Qwen3 causal-LM folder")
    parser.add_argument("--bug", action="append", default=[], choices=BUGS)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    losses = train(args.target, set(args.bug), args.steps)
    if not all(math.isfinite(x) for x in losses):
        raise SystemExit("loss went non-finite")


if __name__ == "__main__":
    main()

"""Team B's DFlash drafter trainer: short documents packed into one row, speculators' drafter, a separate loss module.

Each step packs four short random documents into one row with document ids and per-document positions. The target
runs on each document alone; forward hooks on its decoder layers capture the five feature layers and the last layer's
raw output. The drafter is speculators' `DFlashDraftModel` (eager attention on CPU), driven by the team's own
packed forward whose document mask keeps every block inside its document. Targets and the loss live in
`TeacherBlockLoss`, which holds the target's frozen final norm and LM head and takes the last layer's hidden states.
"""

from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers import Qwen3ForCausalLM

from speculators.models.dflash import DFlashDraftModel
from speculators.train.cli import create_transformer_layer_config

BUGS = ("fc_4_of_5", "targets_layer_9", "gamma_7", "target_noise_0.5")

CAPTURE_LAYERS = [1, 3, 5, 7, 9]  # decoder-layer indices whose outputs feed fc (z-lab ids)
BLOCK_SIZE = 6
ANCHORS_PER_ROW = 6
DOC_LENGTHS = (17, 24, 12, 21)
LR = 2e-3


def build_drafter(target_dir: str, bugs: set[str], vocab: int, mask_token_id: int) -> DFlashDraftModel:
    layer_config = create_transformer_layer_config(
        target_dir, num_layers=1, draft_arch="qwen3", hidden_act=None, sliding_window=None,
        full_attention_indices=[0],
    )
    fc_layers = CAPTURE_LAYERS[:4] if "fc_4_of_5" in bugs else CAPTURE_LAYERS
    return DFlashDraftModel.from_training_args(
        layer_config, verifier_name_or_path=target_dir, draft_vocab_size=vocab, block_size=BLOCK_SIZE,
        target_layer_ids=fc_layers, mask_token_id=mask_token_id, draft_attn_impl="eager",
    )


class LayerTap:
    """Forward hooks that keep the raw output of chosen decoder layers."""

    def __init__(self, model: Qwen3ForCausalLM, layer_indices: list[int]) -> None:
        self.outputs: dict[int, torch.Tensor] = {}
        self._handles = [
            model.model.layers[i].register_forward_hook(self._keeper(i)) for i in layer_indices
        ]

    def _keeper(self, index: int):
        def keep(_module, _args, output):
            self.outputs[index] = output[0] if isinstance(output, tuple) else output
        return keep

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


@torch.no_grad()
def capture_packed(target: Qwen3ForCausalLM, documents: list[torch.Tensor], layers: list[int]) -> dict[int, torch.Tensor]:
    """Each document through the target alone; the tapped layers' outputs concatenated into one packed row."""
    tap = LayerTap(target, layers)
    per_layer: dict[int, list[torch.Tensor]] = {i: [] for i in layers}
    try:
        for doc in documents:
            target.model(input_ids=doc[None])
            for i in layers:
                per_layer[i].append(tap.outputs[i])
    finally:
        tap.remove()
    return {i: torch.cat(chunks, dim=1) for i, chunks in per_layer.items()}


def pack(documents: list[torch.Tensor]):
    input_ids = torch.cat(documents)[None]
    document_ids = torch.cat([torch.full((len(d),), n) for n, d in enumerate(documents)])[None]
    position_ids = torch.cat([torch.arange(len(d)) for d in documents])[None]
    return input_ids, document_ids, position_ids


def sample_anchors(document_ids: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Anchors whose whole block stays inside their document (so never in a document's last BLOCK_SIZE tokens)."""
    docs = document_ids[0]
    allowed = torch.zeros_like(docs, dtype=torch.bool)
    for doc in docs.unique():
        where = (docs == doc).nonzero().squeeze(-1)
        allowed[where[: max(len(where) - BLOCK_SIZE, 0)]] = True
    candidates = allowed.nonzero().squeeze(-1)
    chosen = candidates[torch.randperm(len(candidates), generator=generator)[:ANCHORS_PER_ROW]]
    return chosen.sort().values


def document_block_mask(document_ids: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
    """Additive mask [1, 1, n*B, T + n*B]: a block sees its document's tokens before its anchor, and itself."""
    docs = document_ids[0]
    total = docs.numel()
    query_anchor = anchors.repeat_interleave(BLOCK_SIZE)
    kv_pos = torch.arange(total)
    context = (docs[kv_pos][None, :] == docs[query_anchor][:, None]) & (kv_pos[None, :] < query_anchor[:, None])
    block_of = torch.arange(len(query_anchor)) // BLOCK_SIZE
    own_block = block_of[:, None] == block_of[None, :]
    visible = torch.cat([context, own_block], dim=1)
    mask = torch.zeros(visible.shape).masked_fill(~visible, float("-inf"))
    return mask[None, None]


class PackedDrafter(nn.Module):
    """Runs speculators' DFlash draft model over the anchor blocks of one packed row."""

    def __init__(self, dflash: DFlashDraftModel) -> None:
        super().__init__()
        self.dflash = dflash

    def forward(self, input_ids, position_ids, document_ids, context_features, anchors):
        model = self.dflash
        block_tokens = torch.full((1, len(anchors) * BLOCK_SIZE), model.mask_token_id, dtype=torch.long)
        block_tokens[:, ::BLOCK_SIZE] = input_ids[:, anchors]
        hidden = model.embed_tokens(block_tokens)
        context = model.hidden_norm(model.fc(context_features))
        block_positions = (position_ids[0, anchors][:, None] + torch.arange(BLOCK_SIZE)).reshape(1, -1)
        rope = model.rotary_emb(hidden, torch.cat([position_ids, block_positions], dim=1))
        mask = document_block_mask(document_ids, anchors)
        for layer in model.layers:
            hidden = layer(hidden_states=hidden, target_hidden=context, attention_mask=mask,
                           position_embeddings=rope, use_cache=False)
        return model.lm_head(model.norm(hidden))


class TeacherBlockLoss(nn.Module):
    """The target's next-token distributions at the block slots, and the decayed KL the drafter is trained on."""

    def __init__(self, final_norm: nn.Module, lm_head: nn.Module, gamma: float = 4.0, noise_std: float = 0.0,
                 seed: int = 3) -> None:
        super().__init__()
        self.final_norm = final_norm.requires_grad_(False)
        self.lm_head = lm_head.requires_grad_(False)
        self.gamma = gamma
        self.noise_std = noise_std
        self.noise = torch.Generator().manual_seed(seed)

    def slot_decay(self) -> torch.Tensor:
        k = torch.arange(BLOCK_SIZE, dtype=torch.float32)
        return torch.where(k == 0, torch.zeros(()), torch.exp(-(k - 1) / self.gamma))

    @torch.no_grad()
    def teacher_logits(self, last_hidden: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
        """[n, B, V]: slot k of the block at a gets the target's logits at a+k-1 (slot 0: its anchor, unused)."""
        source = anchors[:, None] + torch.arange(BLOCK_SIZE) - 1
        source[:, 0] = anchors
        logits = self.lm_head(self.final_norm(last_hidden[0, source]))
        if self.noise_std:
            logits = logits + self.noise_std * torch.randn(logits.shape, generator=self.noise)
        return logits

    def forward(self, draft_logits, last_hidden, anchors):
        teacher = self.teacher_logits(last_hidden, anchors)
        student_logp = F.log_softmax(draft_logits.view(len(anchors), BLOCK_SIZE, -1), dim=-1)
        teacher_p = F.softmax(teacher, dim=-1)
        kl = F.kl_div(student_logp, teacher_p, reduction="none").sum(-1)  # [n, B]
        in_loss = torch.ones_like(kl)
        in_loss[:, 0] = 0.0
        # one packed row is one sequence
        return (self.slot_decay() * in_loss * kl).sum() / (in_loss.sum() + 1e-5)


def train(target_dir: str, bugs: set[str], steps: int) -> list[float]:
    torch.manual_seed(0)
    target = Qwen3ForCausalLM.from_pretrained(target_dir).eval().requires_grad_(False)
    vocab = target.config.vocab_size
    mask_token_id = vocab - 1
    last_layer = target.config.num_hidden_layers - 1
    teacher_layer = 9 if "targets_layer_9" in bugs else last_layer
    dflash = build_drafter(target_dir, bugs, vocab, mask_token_id)
    drafter = PackedDrafter(dflash)
    loss_fn = TeacherBlockLoss(target.model.norm, target.lm_head, gamma=7.0 if "gamma_7" in bugs else 4.0,
                               noise_std=0.5 if "target_noise_0.5" in bugs else 0.0)
    optimizer = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=LR)
    generator = torch.Generator().manual_seed(1)
    losses = []
    for step in range(steps):
        documents = [torch.randint(1, mask_token_id, (n,), generator=generator) for n in DOC_LENGTHS]
        input_ids, document_ids, position_ids = pack(documents)
        captured = capture_packed(target, documents, sorted({*CAPTURE_LAYERS, last_layer}))
        context_features = torch.cat([captured[i] for i in dflash.target_layer_ids], dim=-1)
        anchors = sample_anchors(document_ids, generator)
        draft_logits = drafter(input_ids, position_ids, document_ids, context_features, anchors)
        loss = loss_fn(draft_logits, captured[teacher_layer], anchors)
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

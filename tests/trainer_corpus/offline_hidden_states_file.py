"""Team F's offline DFlash training: the target's hidden states dumped to a file once, the drafter trained from it.

Stage 1 (`dump_hidden_states`) runs the target once over 6 seeded random samples of 40 to 64 tokens, each alone, and
saves per sample its input ids, the tapped layers' hidden states stacked `[5, T, H]` (with the layer ids once for the
file) and the final hidden state (after the target's final norm) to `hidden_states.pt` in a temporary folder. Stage 2
reads that file back with `torch.load(weights_only=True)` and never runs the target again: only its checkpoint's
embedding and LM head are kept, and the teacher logits are `lm_head(final)` made at train time. The drafter is
z-lab's `DFlashDraftModel` (1 layer, block 4, mask id vocab-1) whose `target_layer_ids` are the ids the reader hands
it. A step is two samples, one drafter call each: all 3 blocks of the sample, its whole context, positions
[0..T-1 ; a..a+B-1 per block], an additive float mask (context before the anchor, the own block); the loss of a
sample is the decayed KL normalised by its trained slots, the step's loss the mean over its samples.
"""

from __future__ import annotations

import argparse
import copy
import math
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F
from dflash.model import DFlashDraftModel
from transformers import AutoConfig, AutoModelForCausalLM

BUGS = ("fc_4_of_5", "targets_layer_9", "gamma_7", "target_noise_0.5")

CAPTURE_LAYERS = [1, 3, 5, 7, 9]  # decoder layer i = hidden_states[i + 1]
N_SAMPLES, MIN_LEN, MAX_LEN = 6, 40, 64
BLOCK_SIZE = 4
BLOCKS_PER_SAMPLE = 3
SAMPLES_PER_STEP = 2


# ---------------------------------------------------------------- stage 1: dump

@torch.no_grad()
def dump_hidden_states(target_dir: str, path: Path, bugs: set[str]) -> None:
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    vocab = target.config.vocab_size
    rng = torch.Generator().manual_seed(2024)
    samples = []
    for _ in range(N_SAMPLES):
        length = int(torch.randint(MIN_LEN, MAX_LEN + 1, (1,), generator=rng))
        input_ids = torch.randint(1, vocab - 1, (1, length), generator=rng)  # 0 is pad, vocab-1 the mask
        out = target(input_ids=input_ids, output_hidden_states=True)
        if "targets_layer_9" in bugs:
            final = target.model.norm(out.hidden_states[10])
        else:
            final = out.hidden_states[-1]  # the model's last hidden state, already through its final norm
        samples.append({
            "input_ids": input_ids[0],
            "taps": torch.stack([out.hidden_states[i + 1][0] for i in CAPTURE_LAYERS]),
            "final": final[0],
        })
    torch.save({"layer_ids": torch.tensor(CAPTURE_LAYERS), "samples": samples}, path)


# ---------------------------------------------------------------- stage 2: train from the file

class HiddenStateFile:
    """Samples read back from the dump, cycled in order."""

    def __init__(self, path: Path, n_taps: int) -> None:
        data = torch.load(path, weights_only=True)
        self.layer_ids = data["layer_ids"][:n_taps].tolist()
        self.samples = data["samples"]
        self.n_taps = n_taps
        self.cursor = 0

    def next_sample(self):
        record = self.samples[self.cursor % len(self.samples)]
        self.cursor += 1
        features = record["taps"][: self.n_taps].permute(1, 0, 2).flatten(1)  # [T, n_taps * H]
        return record["input_ids"], features, record["final"]


def checkpoint_embedding_and_head(target_dir: str):
    """The target's embedding and LM head, frozen; the rest of the model is dropped unused."""
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
    embed = copy.deepcopy(target.get_input_embeddings()).requires_grad_(False)
    head = copy.deepcopy(target.get_output_embeddings()).requires_grad_(False)
    del target
    return embed, head


def build_drafter(target_dir: str, layer_ids: list[int]) -> DFlashDraftModel:
    config = AutoConfig.from_pretrained(target_dir)
    config.num_target_layers = config.num_hidden_layers
    config.num_hidden_layers = 1
    config.layer_types = ["full_attention"]
    config.dflash_config = {"target_layer_ids": layer_ids, "block_size": BLOCK_SIZE,
                            "mask_token_id": config.vocab_size - 1}
    torch.manual_seed(0)
    return DFlashDraftModel(config)


@torch.no_grad()
def teacher_logits(head, final, bugs: set[str], noise_rng: torch.Generator):
    logits = head(final)
    if "target_noise_0.5" in bugs:
        logits = logits + torch.randn(logits.shape, generator=noise_rng) * 0.5
    return logits


def pick_anchors(length: int, rng: torch.Generator) -> torch.Tensor:
    """Sorted anchors in [1, length - B]: context before each, the whole block inside the sample."""
    return (torch.randperm(length - BLOCK_SIZE, generator=rng)[:BLOCKS_PER_SAMPLE] + 1).sort().values


def sample_loss(drafter, embed, head, input_ids, features, teacher, anchors, gamma):
    length, n = input_ids.shape[0], anchors.shape[0]
    offsets = torch.arange(BLOCK_SIZE)
    positions = anchors[:, None] + offsets  # [n, B]
    block_ids = torch.full((n, BLOCK_SIZE), drafter.mask_token_id)
    block_ids[:, 0] = input_ids[anchors]

    query_anchor = positions[:, :1].expand(-1, BLOCK_SIZE).reshape(-1)
    context_ok = torch.arange(length)[None, :] < query_anchor[:, None]
    block_no = torch.arange(n).repeat_interleave(BLOCK_SIZE)
    own_block = block_no[:, None] == block_no[None, :]
    mask = torch.where(torch.cat([context_ok, own_block], dim=1), 0.0, float("-inf"))

    hidden = drafter(position_ids=torch.cat([torch.arange(length), positions.reshape(-1)])[None],
                     attention_mask=mask[None, None], noise_embedding=embed(block_ids.reshape(1, -1)),
                     target_hidden=features[None])
    logits = drafter.compute_logits(hidden[0], head).view(n, BLOCK_SIZE, -1)

    goal = teacher[positions - 1]  # slot k learns the target's prediction made at a + k - 1
    kl = (goal.softmax(-1) * (goal.log_softmax(-1) - logits.log_softmax(-1))).sum(-1)  # [n, B]
    decay = torch.exp(-(offsets - 1).float() / gamma)
    loss_mask = (offsets > 0).float().expand(n, -1)
    return (decay * loss_mask * kl).sum() / (loss_mask.sum() + 1e-5)


def train(target_dir: str, path: Path, bugs: set[str], steps: int) -> list[float]:
    data = HiddenStateFile(path, n_taps=4 if "fc_4_of_5" in bugs else len(CAPTURE_LAYERS))
    embed, head = checkpoint_embedding_and_head(target_dir)
    drafter = build_drafter(target_dir, data.layer_ids).train()
    gamma = 7.0 if "gamma_7" in bugs else 4.0
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=1e-3, weight_decay=0.0)
    anchor_rng = torch.Generator().manual_seed(5)
    noise_rng = torch.Generator().manual_seed(6)
    losses = []
    for step in range(steps):
        per_sample = []
        for _ in range(SAMPLES_PER_STEP):
            input_ids, features, final = data.next_sample()
            teacher = teacher_logits(head, final, bugs, noise_rng)
            anchors = pick_anchors(input_ids.shape[0], anchor_rng)
            per_sample.append(sample_loss(drafter, embed, head, input_ids, features, teacher, anchors, gamma))
        loss = torch.stack(per_sample).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        print(f"step {step} | loss={losses[-1]:.5f}", flush=True)
    return losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", required=True, help="Hugging Face Qwen3 causal-LM folder")
    parser.add_argument("--bug", action="append", default=[], choices=BUGS)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    bugs = set(args.bug)
    with tempfile.TemporaryDirectory() as scratch:
        dump = Path(scratch) / "hidden_states.pt"
        dump_hidden_states(args.target, dump, bugs)
        losses = train(args.target, dump, bugs, args.steps)
    if not all(math.isfinite(x) for x in losses):
        raise SystemExit("non-finite loss")


if __name__ == "__main__":
    main()

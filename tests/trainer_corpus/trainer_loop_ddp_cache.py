"""DFlash trainer in a Hugging Face `Trainer`-like loop: DDP-wrapped drafter, targets precomputed into a dict cache.

Setup: a small `DraftTrainer` class (`get_train_dataloader`, `compute_loss`, `training_step`, `train`) in the style
of transformers' `Trainer`. Before training, the target reads every row of the dataset once and a python dict
`{row_id: {"features", "teacher"}}` keeps its captured layers and its logits (the noise bug is added there). The
drafter is z-lab's `DFlashDraftModel` (1 layer, block 5, mask id vocab-1) inside
`torch.nn.parallel.DistributedDataParallel` on a one-process gloo group. Each (row, anchor) pair becomes one element
of the drafter's batch: the row's whole context with a boolean mask hiding positions at or past the anchor,
positions [0..S-1 ; a..a+B-1]. The loss is a decayed KL averaged over trained slots.
"""

from __future__ import annotations

import argparse
import copy
import os
import tempfile

import torch
import torch.distributed as dist
import torch.nn.functional as F
from dflash.model import DFlashDraftModel
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset
from transformers import AutoConfig, AutoModelForCausalLM

BUGS = ("fc_4_of_5", "targets_layer_9", "gamma_7", "target_noise_0.5")


class TrainingArguments:
    def __init__(self, bugs, steps):
        self.layer_ids = [1, 3, 5, 7] if "fc_4_of_5" in bugs else [1, 3, 5, 7, 9]
        self.teacher_layer = 9 if "targets_layer_9" in bugs else None  # None: the model's own logits
        self.loss_decay_gamma = 7.0 if "gamma_7" in bugs else 4.0
        self.teacher_noise = 0.5 if "target_noise_0.5" in bugs else 0.0
        self.max_steps = steps
        self.per_device_train_batch_size = 2
        self.anchors_per_row = 3
        self.block_size = 5
        self.seq_len = 48
        self.num_rows = 8
        self.learning_rate = 1e-3
        self.max_grad_norm = 1.0
        self.seed = 0


class RandomTokens(Dataset):
    def __init__(self, n, seq_len, vocab, seed):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, vocab - 1, (n, seq_len), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"row_id": i, "input_ids": self.ids[i]}


@torch.no_grad()
def precompute_teacher(target, dataset, args):
    """{row_id: {"features": [S, n*H], "teacher": [S, V]}} for every row, computed once."""
    cache, noise = {}, torch.Generator().manual_seed(args.seed + 1)
    for item in dataset:
        out = target(item["input_ids"][None], output_hidden_states=True)
        features = torch.cat([out.hidden_states[i + 1] for i in args.layer_ids], dim=-1)[0]
        if args.teacher_layer is None:
            teacher = out.logits[0]
        else:
            teacher = target.lm_head(target.model.norm(out.hidden_states[args.teacher_layer + 1]))[0]
        if args.teacher_noise:
            teacher = teacher + args.teacher_noise * torch.randn(teacher.shape, generator=noise)
        cache[item["row_id"]] = {"features": features, "teacher": teacher}
    return cache


class DraftTrainer:
    def __init__(self, model, target, args, train_dataset, teacher_cache):
        self.model, self.target, self.args = model, target, args
        self.train_dataset, self.teacher_cache = train_dataset, teacher_cache
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, betas=(0.9, 0.95))
        self.anchor_gen = torch.Generator().manual_seed(args.seed + 2)

    def get_train_dataloader(self):
        return DataLoader(self.train_dataset, batch_size=self.args.per_device_train_batch_size, shuffle=True,
                          generator=torch.Generator().manual_seed(self.args.seed))

    def compute_loss(self, model, inputs):
        a, B, S = self.args, self.args.block_size, self.args.seq_len
        drafter = model.module
        rows = inputs["row_id"].tolist()
        anchors = torch.stack([torch.randperm(S - B, generator=self.anchor_gen)[: a.anchors_per_row] for _ in rows])
        feats = torch.stack([self.teacher_cache[r]["features"] for r in rows])
        teacher = torch.stack([self.teacher_cache[r]["teacher"] for r in rows])
        # one batch element per (row, anchor)
        pair_row = torch.arange(len(rows)).repeat_interleave(a.anchors_per_row)
        pair_anchor = anchors.flatten()
        slots = pair_anchor[:, None] + torch.arange(B)
        block = torch.full(slots.shape, drafter.mask_token_id, dtype=torch.long)
        block[:, 0] = inputs["input_ids"][pair_row, pair_anchor]
        visible = torch.cat([(torch.arange(S)[None, :] < pair_anchor[:, None])[:, None, :].expand(-1, B, -1),
                             torch.ones(len(pair_row), B, B, dtype=torch.bool)], dim=-1)
        positions = torch.cat([torch.arange(S).expand(len(pair_row), -1), slots], dim=1)
        hidden = model(position_ids=positions, attention_mask=visible[:, None], target_hidden=feats[pair_row],
                       noise_embedding=self.target.model.embed_tokens(block))
        logits = drafter.compute_logits(hidden, self.target.lm_head)  # [P, B, V]
        wanted = teacher[pair_row[:, None], (slots - 1).clamp(min=0)]
        kl = F.kl_div(F.log_softmax(logits, -1), F.log_softmax(wanted, -1), log_target=True, reduction="none").sum(-1)
        k = torch.arange(B, dtype=torch.float32)
        decay = torch.exp(-(k - 1) / a.loss_decay_gamma) * (k > 0)
        return (kl * decay).sum() / (len(pair_row) * (B - 1))

    def training_step(self, model, inputs):
        model.train()
        loss = self.compute_loss(model, inputs)
        loss.backward()
        return loss.detach()

    def train(self):
        step = 0
        while step < self.args.max_steps:
            for inputs in self.get_train_dataloader():
                loss = self.training_step(self.model, inputs)
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.args.max_grad_norm)
                self.optimizer.step()
                self.optimizer.zero_grad()
                print(f"step {step} | loss {loss.item():.5f}", flush=True)
                step += 1
                if step >= self.args.max_steps:
                    break


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", required=True)
    ap.add_argument("--bug", action="append", default=[], choices=BUGS)
    ap.add_argument("--steps", type=int, default=3)
    cli = ap.parse_args(argv)
    args = TrainingArguments(set(cli.bug), cli.steps)

    torch.manual_seed(args.seed)
    target = AutoModelForCausalLM.from_pretrained(cli.target, dtype=torch.float32).eval().requires_grad_(False)
    cfg = copy.deepcopy(AutoConfig.from_pretrained(cli.target))
    cfg.num_target_layers, cfg.num_hidden_layers, cfg.layer_types = cfg.num_hidden_layers, 1, ["full_attention"]
    cfg.dflash_config = {"target_layer_ids": args.layer_ids, "block_size": args.block_size,
                         "mask_token_id": cfg.vocab_size - 1}
    drafter = DFlashDraftModel(cfg)

    started_here = not dist.is_initialized()
    if started_here:
        rendezvous = tempfile.NamedTemporaryFile(prefix="ddp-", delete=False)
        rendezvous.close()
        dist.init_process_group("gloo", init_method=f"file://{rendezvous.name}", rank=0, world_size=1)
    try:
        model = DistributedDataParallel(drafter)
        dataset = RandomTokens(args.num_rows, args.seq_len, cfg.vocab_size, args.seed)
        trainer = DraftTrainer(model, target, args, dataset, precompute_teacher(target, dataset, args))
        trainer.train()
    finally:
        if started_here:
            dist.destroy_process_group()
            os.unlink(rendezvous.name)


if __name__ == "__main__":
    main()

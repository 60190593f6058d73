"""DFlash drafter trained with a stock `transformers.Trainer`: target and drafter in one module, two micro-batches.

Setup: `DraftingPair` is the one `nn.Module` handed to the Trainer; it holds the frozen target (kept in eval mode
whatever the Trainer asks) and z-lab's `DFlashDraftModel` (2 layers, block 4, mask id vocab-1). `BlockKLTrainer`
overrides `compute_loss` only; the Trainer itself does the data loading, `gradient_accumulation_steps=2`, AdamW and
the schedule, on CPU, with no reporting and no checkpoints. Rows have different lengths (36..72 tokens) and the
collator right-pads them with an attention mask and draws 4 sorted anchors per row among its real tokens; a block
may run past the row's end, and its slots there carry no loss. The pair's forward runs the target once on the padded
batch, then drafts every block of the batch in one call with an additive float mask (real context before the
anchor, the own block), positions [0..S-1 ; a..a+B-1]. Loss: KL(target || drafter) at a+k-1, weight exp(-(k-1)/4),
per row sum(w * mask * kl) / (sum(mask) + 1e-5), then the mean over rows.
"""

from __future__ import annotations

import argparse
import copy
import math
import tempfile
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from dflash.model import DFlashDraftModel
from torch import nn
from torch.utils.data import Dataset
from transformers import (AutoModelForCausalLM, PrinterCallback, Trainer, TrainerCallback, TrainingArguments,
                          set_seed)

BUGS = ("fc_4_of_5", "targets_layer_9", "gamma_7", "target_noise_0.5")


@dataclass
class DFlashRecipe:
    feature_layers: tuple[int, ...] = (1, 3, 5, 7, 9)  # hidden_states[i + 1]: the output of decoder layer i
    teacher_layer: int | None = None  # None: the target's own logits (last layer, final norm, head)
    teacher_noise_std: float = 0.0
    decay_gamma: float = 4.0
    block_size: int = 4
    draft_layers: int = 2
    anchors_per_row: int = 4

    @classmethod
    def with_bugs(cls, bugs: set[str]) -> "DFlashRecipe":
        recipe = cls()
        if "fc_4_of_5" in bugs:
            recipe.feature_layers = recipe.feature_layers[:4]
        if "targets_layer_9" in bugs:
            recipe.teacher_layer = 9
        if "gamma_7" in bugs:
            recipe.decay_gamma = 7.0
        if "target_noise_0.5" in bugs:
            recipe.teacher_noise_std = 0.5
        return recipe


class VariableLengthTokens(Dataset):
    """Seeded random rows of 36..72 tokens; ids avoid 0 (the pad id) and the mask id (vocab-1)."""

    def __init__(self, n_rows: int, vocab: int, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        lengths = torch.randint(36, 73, (n_rows,), generator=gen).tolist()
        self.rows = [torch.randint(1, vocab - 1, (n,), generator=gen) for n in lengths]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.rows[i]}


class PadAndAnchor:
    """Right-pads a list of rows and picks the block anchors of each row among its real tokens."""

    def __init__(self, recipe: DFlashRecipe, pad_id: int, seed: int = 1) -> None:
        self.recipe, self.pad_id = recipe, pad_id
        self.gen = torch.Generator().manual_seed(seed)

    def __call__(self, features: list[dict]) -> dict:
        lengths = [len(f["input_ids"]) for f in features]
        width = max(lengths)
        input_ids = torch.full((len(features), width), self.pad_id, dtype=torch.long)
        attention_mask = torch.zeros(len(features), width, dtype=torch.long)
        anchors = []
        for row, (f, n) in enumerate(zip(features, lengths)):
            input_ids[row, :n], attention_mask[row, :n] = f["input_ids"], 1
            # any real token that has at least one real token after it
            anchors.append(torch.randperm(n - 1, generator=self.gen)[: self.recipe.anchors_per_row].sort().values)
        return {"input_ids": input_ids, "attention_mask": attention_mask, "anchors": torch.stack(anchors)}


class DraftingPair(nn.Module):
    """The frozen target and the drafter it teaches, as one module for the Trainer."""

    def __init__(self, target: nn.Module, recipe: DFlashRecipe) -> None:
        super().__init__()
        self.recipe = recipe
        self.target = target.eval().requires_grad_(False)
        cfg = copy.deepcopy(target.config)
        cfg.num_target_layers = cfg.num_hidden_layers
        cfg.num_hidden_layers = recipe.draft_layers
        cfg.layer_types = ["full_attention"] * recipe.draft_layers
        cfg.dflash_config = {"target_layer_ids": list(recipe.feature_layers), "block_size": recipe.block_size,
                             "mask_token_id": cfg.vocab_size - 1}
        self.drafter = DFlashDraftModel(cfg)
        self.noise = torch.Generator().manual_seed(1234)

    def train(self, mode: bool = True) -> "DraftingPair":
        super().train(mode)
        self.target.eval()  # the teacher never trains, not even its dropout
        return self

    @torch.no_grad()
    def teach(self, input_ids, attention_mask):
        out = self.target(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True)
        context = torch.cat([out.hidden_states[i + 1] for i in self.drafter.target_layer_ids], dim=-1)
        if self.recipe.teacher_layer is None:
            teacher = out.logits
        else:
            teacher = self.target.lm_head(self.target.model.norm(out.hidden_states[self.recipe.teacher_layer + 1]))
        if self.recipe.teacher_noise_std:
            teacher = teacher + self.recipe.teacher_noise_std * torch.randn(teacher.shape, generator=self.noise)
        return context, teacher

    def forward(self, input_ids, attention_mask, anchors):
        context, teacher = self.teach(input_ids, attention_mask)
        rows, width = input_ids.shape
        B = self.recipe.block_size
        slot = torch.arange(B).repeat(anchors.shape[1])  # k of every query, [n*B]
        positions = anchors.repeat_interleave(B, dim=1) + slot  # [rows, n*B]
        block_ids = torch.full_like(positions, self.drafter.mask_token_id)
        block_ids[:, ::B] = input_ids.gather(1, anchors)  # [anchor token, mask x (B-1)]
        # additive mask: a block's queries see the real context before its anchor, and their own block
        query_anchor = positions - slot
        sees = torch.cat([(torch.arange(width) < query_anchor[:, :, None]) & attention_mask[:, None, :].bool(),
                          (query_anchor[:, :, None] == query_anchor[:, None, :])], dim=-1)
        bias = torch.zeros(sees.shape).masked_fill(~sees, torch.finfo(torch.float32).min)[:, None]
        hidden = self.drafter(position_ids=torch.cat([torch.arange(width).expand(rows, -1), positions], dim=1),
                              attention_mask=bias, noise_embedding=self.target.model.embed_tokens(block_ids),
                              target_hidden=context)
        draft = self.drafter.compute_logits(hidden, self.target.lm_head)
        # slot k learns the target's next-token distribution at a+k-1; slots past the row's end carry no loss
        source = (positions - 1).clamp(min=0, max=width - 1)  # slot 0 and slots past the end: unused
        wanted = teacher.gather(1, source[:, :, None].expand(-1, -1, teacher.shape[-1]))
        lengths = attention_mask.sum(dim=1, keepdim=True)
        slot_mask = ((positions < lengths) & (slot > 0)).float()
        return {"draft_logits": draft, "teacher_logits": wanted, "slot_mask": slot_mask, "slot": slot}


class BlockKLTrainer(Trainer):
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        out = model(**inputs)
        gamma = self.model.recipe.decay_gamma
        slot = out["slot"].float()
        weight = torch.where(slot > 0, torch.exp(-(slot - 1) / gamma), torch.zeros_like(slot))
        log_p = F.log_softmax(out["teacher_logits"].float(), dim=-1)
        log_q = F.log_softmax(out["draft_logits"].float(), dim=-1)
        kl = (log_p.exp() * (log_p - log_q)).sum(-1)  # [rows, n*B]
        mask = out["slot_mask"]
        loss = ((weight * mask * kl).sum(dim=1) / (mask.sum(dim=1) + 1e-5)).mean()
        return (loss, out) if return_outputs else loss


class PrintLoss(TrainerCallback):
    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            print(f"step {state.global_step} loss {logs['loss']:.5f}", flush=True)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", required=True, help="Hugging Face Qwen3 causal-LM folder")
    ap.add_argument("--bug", action="append", default=[], choices=BUGS)
    ap.add_argument("--steps", type=int, default=3)
    cli = ap.parse_args(argv)
    recipe = DFlashRecipe.with_bugs(set(cli.bug))

    set_seed(0)
    target = AutoModelForCausalLM.from_pretrained(cli.target, dtype=torch.float32)
    pair = DraftingPair(target, recipe)
    pad_id = target.config.pad_token_id if target.config.pad_token_id is not None else 0
    per_device, accumulate = 2, 2
    dataset = VariableLengthTokens(cli.steps * per_device * accumulate, target.config.vocab_size)
    with tempfile.TemporaryDirectory(prefix="dflash-trainer-") as out_dir:
        args = TrainingArguments(output_dir=out_dir, max_steps=cli.steps, per_device_train_batch_size=per_device,
                                 gradient_accumulation_steps=accumulate, learning_rate=1e-3, weight_decay=0.01,
                                 logging_steps=1, save_strategy="no", report_to="none", use_cpu=True, seed=0,
                                 remove_unused_columns=False, dataloader_num_workers=0, disable_tqdm=True)
        trainer = BlockKLTrainer(model=pair, args=args, train_dataset=dataset,
                                 data_collator=PadAndAnchor(recipe, pad_id))
        trainer.remove_callback(PrinterCallback)
        trainer.add_callback(PrintLoss())
        result = trainer.train()
    if not math.isfinite(result.training_loss):
        raise SystemExit("loss went non-finite")


if __name__ == "__main__":
    main()

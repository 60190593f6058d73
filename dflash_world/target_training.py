"""Train a tiny Qwen3 causal LM from scratch on the corpus: the target model of the demo world."""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Sequence
from pathlib import Path

import torch
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from transformers import PreTrainedTokenizerBase, Qwen3Config, Qwen3ForCausalLM

from foundation.atomic import atomic_directory

from .presets import DEMO_TARGET, TEST_TARGET  # noqa: F401 (their home before presets.py; still imported from here)

STATS_FILE = "build_stats.json"
WARMUP_FRACTION = 0.05
MIN_LR_FRACTION = 0.1


def random_qwen3(num_layers: int, hidden: int, vocab: int, seed: int = 0, head_dim: int = 16,
                 heads: int = 4, kv_heads: int = 2, max_positions: int = 512) -> Qwen3ForCausalLM:
    """The one tiny random-weight Qwen3 target the suites build (SDPA attention, untied head)."""
    torch.manual_seed(seed)
    config = Qwen3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=num_layers,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                         tie_word_embeddings=False, max_position_embeddings=max_positions)
    config._attn_implementation = "sdpa"
    return Qwen3ForCausalLM(config).eval()


def distinct_random_qwen3(num_layers: int, hidden: int, vocab: int, seed: int = 0) -> Qwen3ForCausalLM:
    """A random Qwen3 whose tensors are told apart by value as a trained model's are: embeddings of unit scale,
    norm weights away from 1 (a final norm applied twice is not the norm applied once), a head whose logits spread
    over several units. `trace`'s tests and bench run a team's trainer on it (12 layers: z-lab's layer rule picks
    five distinct ones, where the test world's 4-layer target gives it a single one)."""
    model = random_qwen3(num_layers, hidden, vocab, seed=seed, head_dim=16)
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        model.lm_head.weight.mul_(20 * (64 / hidden) ** 0.5)
        model.model.embed_tokens.weight.mul_(50)
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=generator))
    model.config.pad_token_id = 0
    return model


def pack_tokens(tokenizer: PreTrainedTokenizerBase, texts: Sequence[str], seq_len: int) -> torch.Tensor:
    """All texts as one EOS-separated token stream, cut into rows of `seq_len` tokens."""
    stream: list[int] = []
    for ids in tokenizer(list(texts))["input_ids"]:  # one batched call: tokenizes in parallel
        stream.extend(ids)
        stream.append(tokenizer.eos_token_id)
    rows = len(stream) // seq_len
    if rows == 0:
        raise ValueError(f"corpus has {len(stream)} tokens, fewer than one sequence of {seq_len}")
    return torch.tensor(stream[: rows * seq_len]).view(rows, seq_len)


def _lr_factor(step: int, steps: int) -> float:
    """Linear warmup, then cosine decay to MIN_LR_FRACTION of the peak."""
    warmup = max(1, int(steps * WARMUP_FRACTION))
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return MIN_LR_FRACTION + (1 - MIN_LR_FRACTION) * 0.5 * (1 + math.cos(math.pi * progress))


def target_config(tokenizer: PreTrainedTokenizerBase, *, hidden_size: int, num_layers: int,
                  heads: int, kv_heads: int, head_dim: int, intermediate_size: int) -> Qwen3Config:
    return Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=4096,
        # Separate embedding and LM-head tensors, as in the Qwen3-8B targets DFlash
        # drafters are published for; drafters copy or share both.
        tie_word_embeddings=False,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
        attn_implementation="sdpa",
    )


def build_target(
    out_dir: str | os.PathLike,
    tokenizer: PreTrainedTokenizerBase,
    texts: Sequence[str],
    *,
    hidden_size: int,
    num_layers: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    intermediate_size: int,
    seq_len: int,
    steps: int,
    batch_size: int,
    lr: float,
    seed: int,
    progress: bool = True,
) -> dict:
    """Train the target and save it (model, generation config, tokenizer) as an HF directory.

    The directory is written next to `out_dir` and moved into place only when complete
    (replacing any previous one), so `out_dir` never holds a half-written model.
    Returns build stats, also saved as `build_stats.json` in the directory.
    """
    out_dir = Path(out_dir)
    started = time.monotonic()
    torch.manual_seed(seed)
    data = pack_tokens(tokenizer, texts, seq_len)
    model = Qwen3ForCausalLM(target_config(
        tokenizer, hidden_size=hidden_size, num_layers=num_layers, heads=heads,
        kv_heads=kv_heads, head_dim=head_dim, intermediate_size=intermediate_size,
    ))
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    losses = _train(model, data, steps=steps, batch_size=batch_size, lr=lr, seed=seed,
                    progress=progress)
    model.eval()

    tail = losses[-max(1, steps // 20):]
    stats = {
        "initial_loss": losses[0],
        "final_loss": sum(tail) / len(tail),
        "params": sum(p.numel() for p in model.parameters()),
        "train_tokens": data.numel(),
        "tokens_seen": steps * batch_size * seq_len,
        "seconds": round(time.monotonic() - started, 1),
    }

    def fill(staging: Path) -> None:
        model.save_pretrained(staging, safe_serialization=True)
        tokenizer.save_pretrained(staging)
        (staging / STATS_FILE).write_text(json.dumps(stats, indent=2) + "\n")

    atomic_directory(out_dir, fill)  # replaces a previous (incomplete-world) target
    return stats


def _train(model: Qwen3ForCausalLM, data: torch.Tensor, *, steps: int, batch_size: int,
           lr: float, seed: int, progress: bool) -> list[float]:
    """AdamW over random batches of packed rows; returns the loss of every step."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: _lr_factor(step, steps))
    batches = torch.Generator().manual_seed(seed)
    model.train()
    losses: list[float] = []
    bar = Progress(TextColumn("training target"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                   TextColumn("loss {task.fields[loss]:.3f}"), TimeElapsedColumn(), disable=not progress)
    with bar:
        task = bar.add_task("train", total=steps, loss=float("nan"))
        for _ in range(steps):
            rows = data[torch.randint(len(data), (batch_size,), generator=batches)]
            loss = model(input_ids=rows, labels=rows).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())
            bar.update(task, advance=1, loss=loss.item())
    return losses

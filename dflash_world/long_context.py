"""The test world's long context: a target that has seen rows as long as its 4096 positions, and prompts up to them.

The test target is trained on 256-token rows: past them its own predictions are extrapolation, and a drafter's τ
there mixes the drafter's faults with the target's. The long target is that target, trained on for a few steps on
rows of 4096 tokens (its whole rotary range) rather than retrained, beside it: every figure the suites pin on the
test target stays as it is. Long prompts are cut from the held-out split (files the target never saw), at whole
lines, to about 512 to 4032 tokens, so that with 64 new tokens the longest reaches the target's last position.

Both are built once per world under the kernel pins (kernel_pins.py), like every artefact of it.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from foundation.cache_dir import build_once

from .corpus import stdlib_corpus
from .kernel_pins import run_pinned
from .world_cache import WorldPaths
from .world_prompts import write_prompts_jsonl

# A fixed step count (never a time budget): the same weights on every machine. About 3.8 s a step on one core.
LONG_TARGET = dict(seq_len=4096, steps=32, batch_size=1, lr=1e-3, seed=0)
LONG_TARGET_DIR = "target-long"
LONG_PROMPTS_FILE = "prompts-long.jsonl"
# Prompt lengths in tokens (each cut at a line end at or below it): 4032 + 64 new tokens = the target's 4096.
LONG_PROMPT_TOKENS = (512, 1024, 2048, 4032)
LONG_PROMPT_CHARS = 200_000


def long_target_dir(world: WorldPaths) -> Path:
    return world.root / LONG_TARGET_DIR


def train_long_target(world: WorldPaths, progress: bool = False) -> Path:
    """`<world>/target-long/`: the test target trained on for LONG_TARGET's steps on rows of its full length
    (`pinned_build`'s job: the caller holds the lock and the pins)."""
    import torch
    from transformers import AutoTokenizer, Qwen3ForCausalLM

    from foundation.atomic import atomic_directory
    from foundation.transformers_compat import from_pretrained

    from .target_training import STATS_FILE, _train, pack_tokens

    out = long_target_dir(world)
    started = time.monotonic()
    settings = LONG_TARGET
    torch.manual_seed(settings["seed"])
    tokenizer = AutoTokenizer.from_pretrained(world.target)
    model = from_pretrained(Qwen3ForCausalLM, world.target, dtype=torch.float32)
    data = pack_tokens(tokenizer, stdlib_corpus("train"), settings["seq_len"])
    losses = _train(model, data, steps=settings["steps"], batch_size=settings["batch_size"], lr=settings["lr"],
                    seed=settings["seed"], progress=progress)
    model.eval()
    stats = {"continued_from": "target", **settings, "initial_loss": losses[0], "final_loss": losses[-1],
             "seconds": round(time.monotonic() - started, 1)}

    def fill(staging: Path) -> None:
        model.save_pretrained(staging, safe_serialization=True)
        tokenizer.save_pretrained(staging)
        (staging / STATS_FILE).write_text(json.dumps(stats, indent=2) + "\n")

    atomic_directory(out, fill)
    return out


def cached_long_target(world: WorldPaths) -> Path:
    """`<world>/target-long/`, trained on first use under the kernel pins (a child process)."""
    out = long_target_dir(world)

    def built():
        return out if (out / "config.json").is_file() else None

    def train() -> Path:
        run_pinned({"what": "long-target", "root": str(world.root)})
        return out

    return build_once(world.root / ".target-long.lock", built, train)


def long_prompts(tokenizer, lengths=LONG_PROMPT_TOKENS) -> list[dict]:
    """One prompt per length, each from its own stretch of the held-out files joined end to end (a prompt never
    repeats another's text), cut at the last line end at or below the length and without trailing whitespace (the
    built-in prompts' rule)."""
    text = "\n\n".join(stdlib_corpus("heldout"))[:LONG_PROMPT_CHARS]  # enough for every length, quick to tokenize
    encoded = tokenizer(text, return_offsets_mapping=True, add_special_tokens=False)
    offsets = encoded["offset_mapping"]
    prompts, token = [], 0
    for length in lengths:
        begin = offsets[token][0]
        end = offsets[min(token + length, len(offsets) - 1)][0]
        prompt = text[begin:text.rfind("\n", begin, end)].rstrip()
        prompts.append({"id": f"long-{length}", "prompt": prompt})
        token += length
    return prompts


def cached_long_prompts(world: WorldPaths) -> Path:
    """`<world>/prompts-long.jsonl` (tokenization only: no pins needed)."""
    path = world.root / LONG_PROMPTS_FILE

    def write() -> Path:
        from transformers import AutoTokenizer

        write_prompts_jsonl(path, long_prompts(AutoTokenizer.from_pretrained(world.target)))
        return path

    return build_once(world.root / ".prompts-long.lock", lambda: path if path.is_file() else None, write)

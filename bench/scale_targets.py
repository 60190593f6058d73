"""Targets at the published Qwen3 shapes with random weights, generated on the fly for bench_dynamic_scale
(never committed), and DFlash drafters to match.

The target is written as safetensors shards in bf16, one tensor at a time (a few MB of float32
scratch, never the model in float32, never the model in memory at all). Its tokenizer is the
test world's: the prompts only need valid ids, and a larger embedding than the tokenizer's
vocabulary is what a real target has too.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from scale_drafters import SHAPES as DRAFTER_SHAPES
from scale_drafters import body_shapes, random_tensor, write_safetensors, write_zlab

from impl.layers import build_target_layer_ids
from impl.spec import DraftSpec

SHARD_BYTES = 2 << 30
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


@dataclass(frozen=True)
class TargetShape:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    tie_word_embeddings: bool


# The published Qwen3 configs' dimensions (Qwen/Qwen3-1.7B, Qwen/Qwen3-8B); "tiny" keeps the CPU test quick.
TARGETS = {
    "tiny": TargetShape(64, 128, 6, 4, 2, 16, 2048, False),
    "qwen3-0.6b": TargetShape(1024, 3072, 28, 16, 8, 128, 151936, True),
    # The same widths at half the depth: what the trace's audit costs per target layer (it must cost nothing).
    "qwen3-0.6b-14-layers": TargetShape(1024, 3072, 14, 16, 8, 128, 151936, True),
    "qwen3-1.7b": TargetShape(2048, 6144, 28, 16, 8, 128, 151936, True),
    "qwen3-8b": TargetShape(4096, 12288, 36, 32, 8, 128, 151936, False),
}


def target_config(shape: TargetShape) -> dict:
    return {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "dtype": "bfloat16",
            "hidden_size": shape.hidden_size, "intermediate_size": shape.intermediate_size,
            "num_hidden_layers": shape.num_hidden_layers, "num_attention_heads": shape.num_attention_heads,
            "num_key_value_heads": shape.num_key_value_heads, "head_dim": shape.head_dim,
            "vocab_size": shape.vocab_size, "tie_word_embeddings": shape.tie_word_embeddings,
            "hidden_act": "silu", "rms_norm_eps": 1e-6, "max_position_embeddings": 40960,
            "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"}, "attention_bias": False,
            "use_sliding_window": False, "sliding_window": None, "bos_token_id": None, "eos_token_id": 0,
            "pad_token_id": 0, "use_cache": True}


def target_shapes(shape: TargetShape) -> dict[str, tuple[int, ...]]:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(**{k: v for k, v in target_config(shape).items() if k != "architectures"})
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    return {k: tuple(v.shape) for k, v in model.state_dict().items()
            if not (shape.tie_word_embeddings and k == "lm_head.weight")}


def write_target(folder: Path, name: str, tokenizer_from: Path | None) -> Path:
    """A Qwen3 target at shape `name` with random bf16 weights, sharded safetensors + index (and the tokenizer of
    `tokenizer_from`, where a tokenizer is needed)."""
    shape = TARGETS[name]
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(target_config(shape), indent=2, sort_keys=True))
    for file in TOKENIZER_FILES if tokenizer_from is not None else ():
        shutil.copyfile(tokenizer_from / file, folder / file)
    shapes = sorted(target_shapes(shape).items())
    shards, current, size = [], [], 0
    for key, dims in shapes:
        nbytes = 2 * _numel(dims)
        if current and size + nbytes > SHARD_BYTES:
            shards.append(current)
            current, size = [], 0
        current.append((key, dims))
        size += nbytes
    shards.append(current)
    weight_map = {}
    for number, shard in enumerate(shards, 1):
        file = f"model-{number:05d}-of-{len(shards):05d}.safetensors"
        write_safetensors(folder / file, [(k, s, torch.bfloat16, lambda s=s, k=k: random_tensor(s, _seed(k)))
                                          for k, s in shard])
        weight_map.update({k: file for k, _ in shard})
    total = sum(2 * _numel(s) for _, s in shapes)
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    return folder


def drafter_spec(name: str) -> DraftSpec:
    """The z-lab Qwen3-8B-DFlash-b16 recipe (5 draft layers, block 16, head_dim 128, ids spread over the
    target by z-lab's rule) at the target's width; the 8B target gets the published drafter's shape."""
    shape = TARGETS[name]
    if name == "tiny":
        return DRAFTER_SHAPES["tiny"].replace(target_vocab_size=shape.vocab_size, mask_token_id=shape.vocab_size - 1)
    if name in DRAFTER_SHAPES:
        return DRAFTER_SHAPES[name]
    recipe = DRAFTER_SHAPES["qwen3-8b"]
    return recipe.replace(hidden_size=shape.hidden_size, intermediate_size=shape.intermediate_size,
                   num_attention_heads=shape.num_attention_heads, num_key_value_heads=shape.num_key_value_heads,
                   head_dim=shape.head_dim, num_target_layers=shape.num_hidden_layers,
                   target_layer_ids=tuple(build_target_layer_ids(shape.num_hidden_layers,
                                                                 len(recipe.target_layer_ids))))


def write_drafter(folder: Path, spec: DraftSpec, seed: int) -> Path:
    return write_zlab(folder, spec, [(k, s, torch.bfloat16, lambda s=s, i=i: random_tensor(s, seed * 1000 + i))
                                     for i, (k, s) in enumerate(sorted(body_shapes(spec).items()))])


def _seed(key: str) -> int:
    return sum(ord(c) * (i + 1) for i, c in enumerate(key)) % (2**31)


def _numel(shape) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return count

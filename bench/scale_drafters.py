"""Drafter pairs at the published shapes, generated on the fly for bench_static_scale (never committed).

Random bf16 weights under the real config: the pair is written tensor by tensor, so making
a 3.46 GB drafter needs one tensor's memory, not the drafter's. The shapes are the published
configs' dimensions; the drafters have no embeddings or head of their own (they borrow the
target's), so the vocabulary only sizes nothing here but the config.
"""

from __future__ import annotations

import json
import struct
from dataclasses import replace
from pathlib import Path

import torch

from impl.layers import build_target_layer_ids
from impl.model import DFlashDrafter
from impl.spec import DraftSpec
from drafter_files.zlab_format import zlab_config

# Qwen3.6-27B-DFlash (z-lab) and Qwen3-8B-DFlash-b16 (z-lab): 5 draft layers over the target's
# hidden size; head_dim 128, 32 query / 8 KV heads; fc reads 5 target layers.
SHAPES = {
    "qwen3.6-27b": DraftSpec(hidden_size=5120, intermediate_size=17408, num_attention_heads=32, num_key_value_heads=8,
                             head_dim=128, num_hidden_layers=5, target_vocab_size=248320,
                             target_layer_ids=tuple(build_target_layer_ids(64, 5)), num_target_layers=64,
                             mask_token_id=248070, block_size=16),
    "qwen3-8b": DraftSpec(hidden_size=4096, intermediate_size=12288, num_attention_heads=32, num_key_value_heads=8,
                          head_dim=128, num_hidden_layers=5, target_vocab_size=151936,
                          target_layer_ids=tuple(build_target_layer_ids(36, 5)), num_target_layers=36,
                          mask_token_id=151669, block_size=16),
    "tiny": DraftSpec(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=16, num_hidden_layers=2, target_vocab_size=256, target_layer_ids=(1, 3), num_target_layers=6,
                      mask_token_id=255, block_size=8),
}
DTYPE_NAMES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32"}


def body_shapes(spec: DraftSpec) -> dict[str, tuple[int, ...]]:
    with torch.device("meta"):
        return {k: tuple(v.shape) for k, v in DFlashDrafter(spec).state_dict().items()}


def write_safetensors(path: Path, tensors) -> None:
    """`tensors`: (name, shape, dtype, make) with make() -> the tensor; each is made, written and dropped."""
    tensors = list(tensors)
    header, offset = {}, 0
    for name, shape, dtype, _ in tensors:
        size = dtype.itemsize
        for dim in shape:
            size *= dim
        header[name] = {"dtype": DTYPE_NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    header["__metadata__"] = {"format": "pt"}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as handle:
        handle.write(struct.pack("<Q", len(text)) + text)
        for name, shape, dtype, make in tensors:
            tensor = make().contiguous()
            assert tuple(tensor.shape) == tuple(shape) and tensor.dtype == dtype, name
            handle.write(memoryview(tensor.reshape(-1).view(torch.uint8).numpy()))
            del tensor


def random_tensor(shape, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if len(shape) == 1:  # norms: around 1, as trained
        return (1 + 0.05 * torch.randn(shape, generator=gen)).to(torch.bfloat16)
    out = torch.empty(shape, dtype=torch.bfloat16)
    rows = max(1, (1 << 22) // shape[1])  # a few MB of float32 at a time
    for start in range(0, shape[0], rows):
        block = torch.randn((min(rows, shape[0] - start), shape[1]), generator=gen)
        out[start:start + rows] = (block * 0.02).to(torch.bfloat16)
    return out


def write_zlab(folder: Path, spec: DraftSpec, tensors) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(zlab_config(spec), indent=2, sort_keys=True))
    write_safetensors(folder / "model.safetensors", tensors)
    return folder


def write_pair(root: Path, shape: str) -> dict[str, Path]:
    """ref/ (random weights), same/ (a byte copy: nothing to find) and fc4/ (the same drafter with fc over
    the first 4 of 5 target layers: exactly one fc_dims finding)."""
    from safetensors import safe_open

    spec = SHAPES[shape]
    shapes = body_shapes(spec)
    ref = write_zlab(root / "ref", spec, [(k, s, torch.bfloat16, lambda s=s, i=i: random_tensor(s, i))
                                          for i, (k, s) in enumerate(sorted(shapes.items()))])
    same = root / "same"
    same.mkdir()
    for name in ("config.json", "model.safetensors"):
        with open(ref / name, "rb") as src, open(same / name, "wb") as dst:
            while chunk := src.read(1 << 24):
                dst.write(chunk)
    fc4 = replace(spec, target_layer_ids=spec.target_layer_ids[:-1])
    width = spec.hidden_size * (len(spec.target_layer_ids) - 1)
    with safe_open(str(ref / "model.safetensors"), framework="pt") as handle:
        def take(key):
            tensor = handle.get_tensor(key)
            return tensor[:, :width] if key == "fc.weight" else tensor
        fc4_shapes = body_shapes(fc4)
        write_zlab(root / "fc4", fc4, [(k, s, torch.bfloat16, lambda k=k: take(k)) for k, s in sorted(fc4_shapes.items())])
    return {"ref": ref, "same": same, "fc4": root / "fc4", "spec": spec}

"""A digest of a test world's weights: its targets (the test target and the long one) and the prebuilt drafters, each tensor by name, dtype, shape
and bytes (not the files' bytes: a container's layout is not the weights). Trained under the kernel pins
(kernel_pins.py), they are the same bits on every x86-64 machine with AVX2; tests/test_world_pins.py holds the cached
world to the digest recorded in tests/fixtures/world_digest.json.

`python -m dflash_world.world_digest` prints the cached world's (building it under the pins if it is missing), in the
form the fixture records.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from drafter_files.checkpoint import load_checkpoint

from .drafter import DRAFTERS, cached_drafter
from .long_context import cached_long_target
from .world_cache import WorldPaths, cached_test_world


def tensors_digest(tensors: dict[str, torch.Tensor]) -> str:
    digest = hashlib.sha256()
    for name in sorted(tensors):
        tensor = tensors[name].detach().cpu().contiguous()
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def target_tensors(target: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(Path(target).glob("*.safetensors")):
        tensors.update(load_file(file))
    return tensors


def world_digest(world: WorldPaths) -> dict[str, str]:
    """{"target": ..., each drafter's name: ...}; the drafters are trained (pinned) where missing."""
    found = {"target": tensors_digest(target_tensors(world.target)),
             "target-long": tensors_digest(target_tensors(cached_long_target(world)))}
    for name in DRAFTERS:
        found[name] = tensors_digest(load_checkpoint(cached_drafter(world, name)).state_dict)
    return found


if __name__ == "__main__":
    print(json.dumps(world_digest(cached_test_world()), indent=2))

"""Where and in what precision the suites run the dynamic path: the one switch every fixture reads.

- `DFLASH_AUDIT_DEVICE` (default cpu): the device the models go to (`make gpu-check` says cuda).
- `DFLASH_AUDIT_DTYPE` (default float32): the dtype of the target and the drafters. Under bfloat16
  (`make test`'s second pass over the tests marked `dynamic`) the test world's target is served as a
  bfloat16 checkpoint (`world_in_suite_dtype`): its config declares the dtype and its weights are
  stored in it, so the CLI's `--dtype auto` runs it in bfloat16 exactly as a user's bf16 target runs.
"""

from __future__ import annotations

import os
import shutil

import torch

from foundation.placement import DTYPES, Placement, dtype_name

from .world_cache import WorldPaths

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")


def audit_device() -> torch.device:
    return torch.device(os.environ.get("DFLASH_AUDIT_DEVICE", "cpu"))


def audit_dtype() -> torch.dtype:
    name = os.environ.get("DFLASH_AUDIT_DTYPE", "float32")
    if name not in DTYPES:
        raise ValueError(f"DFLASH_AUDIT_DTYPE must be one of {', '.join(DTYPES)}, got {name!r}")
    return DTYPES[name]


def audit_placement() -> Placement:
    """The placement the suites load the target with (eager attention below float32, as the CLI)."""
    return Placement(audit_device(), audit_dtype(), "DFLASH_AUDIT_DTYPE")


def world_in_suite_dtype(world: WorldPaths) -> WorldPaths:
    """`world` itself in float32 (its target's own dtype); in another dtype the same world with its
    target re-saved in that dtype next to it (`<root>/target-<dtype>/`, built once, atomically)."""
    from foundation.atomic import atomic_directory
    from foundation.cache_dir import build_once

    dtype = audit_dtype()
    if dtype == torch.float32:
        return world
    copy = world.root / f"target-{dtype_name(dtype)}"

    def build() -> WorldPaths:
        from transformers import AutoModelForCausalLM

        from foundation.transformers_compat import from_pretrained

        def fill(tmp):
            model = from_pretrained(AutoModelForCausalLM, world.target, dtype=dtype)
            model.save_pretrained(tmp)  # config.json now declares the dtype
            for name in TOKENIZER_FILES:
                if (world.target / name).is_file():
                    shutil.copy2(world.target / name, tmp / name)

        atomic_directory(copy, fill)
        return WorldPaths(world.root, copy, world.prompts)

    return build_once(world.root / f".{copy.name}.lock",
                      lambda: WorldPaths(world.root, copy, world.prompts) if (copy / "config.json").is_file() else None,
                      build)


def placed_target(model):
    """An in-memory (random) target as the suites' switch places it: itself in float32 on the CPU, else
    saved and loaded back the way the CLI loads a target (`load_target_model`: the dtype on load, its
    rotary buffers left in float32, eager attention below float32)."""
    import tempfile

    from foundation.target import load_target_model

    placement = audit_placement()
    if placement.dtype == torch.float32 and placement.device.type == "cpu":
        return model
    with tempfile.TemporaryDirectory(prefix="dflash-suite-target-") as tmp:
        model.save_pretrained(tmp)
        return load_target_model(tmp, placement)


def placed_drafter(drafter):
    """A drafter as the suites' switch places it: rebuilt in the suite's dtype on its device
    (`built_in`, as `compare` and `eval` build one)."""
    from impl.body_shapes import build_drafter
    from foundation.placement import built_in

    placement = audit_placement()
    return built_in(placement.device, placement.dtype,
                    lambda: build_drafter(drafter.spec, drafter.state_dict())).eval()

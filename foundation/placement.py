"""Where the dynamic path runs, and in what precision: `--device`, `--dtype` and `--device-map`
resolved once into a `Placement` that every command hands down.

Everything past this point takes its device from the model it is given (`model_device`,
`target_device`), never from a global: a sharded target reads its inputs on the device of
its input embeddings, and the drafter sits there too.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from foundation.errors import AuditError
from foundation.inputs import check_target_dir

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class Placement:
    device: torch.device  # the target's input device; the drafters run here
    dtype: torch.dtype  # the target's dtype; the drafters run in it too (their serving dtype)
    dtype_source: str  # where the dtype came from, said in the report
    device_map: str | None = None  # "auto": accelerate shards the target over the GPUs, then the CPU

    @property
    def attn_implementation(self) -> str | None:
        """Eager attention below float32. The live loop runs the target a block at a time, the cache
        in one pass; SDPA's fused kernels tile the softmax by query length, so in bfloat16 the two
        round differently (layer outputs apart by up to 0.125 on the test world, three prompts in
        eight walk differently). Eager attention computes every row the same whatever the chunk.
        float32 keeps the transformers default, where the same tiling moves the states by ~1e-6."""
        return None if self.dtype == torch.float32 else "eager"

    def describe(self) -> dict:
        return {"device": str(self.device), "device_map": self.device_map, "dtype": dtype_name(self.dtype),
                "dtype_source": self.dtype_source, "attention": self.attn_implementation or "default"}

    def with_dtype(self, dtype: torch.dtype, source: str) -> Placement:
        return Placement(self.device, dtype, source, self.device_map)


CPU_FLOAT32 = Placement(torch.device("cpu"), torch.float32, "default")


def declared_dtype(target_dir: str | Path) -> str | None:
    """The dtype a target's config.json declares (`dtype`, or the older `torch_dtype`), or None.

    The directory passes the target checks first: this is the first read of config.json, and a FIFO
    there would block it forever; an unreadable config is an error, never "not declared"."""
    config = check_target_dir(Path(target_dir), tokenizer=False)
    text = config.get("dtype") or config.get("torch_dtype") or config.get("text_config", {}).get("dtype")
    return text if isinstance(text, str) else None


def resolve_dtype(flag: str, target_dir: str | Path | None) -> tuple[torch.dtype, str]:
    """(dtype, where it came from) for one `--dtype` value."""
    if flag != "auto":  # a name the flag's declaration allows (dflash_audit/verb_flags.py)
        return DTYPES[flag], "--dtype"
    declared = declared_dtype(target_dir) if target_dir is not None else None
    if declared is None:
        return torch.float32, "not declared in the target's config.json: float32"
    if declared not in DTYPES:
        raise AuditError(f"{target_dir}/config.json declares dtype {declared!r}, which the audit does not run; "
                         f"pass --dtype {'|'.join(DTYPES)}")
    return DTYPES[declared], "the target's config.json"


def local_rank(env=os.environ) -> int | None:
    """torchrun's LOCAL_RANK when several processes share this machine, else None."""
    if int(env.get("WORLD_SIZE", "1")) <= 1:
        return None
    return int(env.get("LOCAL_RANK", env.get("RANK", "0")))


def resolve_device(flag: str, rank: int | None = None, cuda_count: int | None = None) -> torch.device:
    """`auto` = CUDA when available; under torchrun each rank takes GPU `LOCAL_RANK`. `flag` is one the `--device`
    declaration allows (auto, cpu, cuda, cuda:N); what this machine has is judged here."""
    count = torch.cuda.device_count() if cuda_count is None else cuda_count
    if flag == "auto":
        flag = "cuda" if count else "cpu"
    if flag == "cpu":
        return torch.device("cpu")
    if count == 0:
        raise AuditError(f"--device {flag}: no CUDA device is available here (use --device cpu)")
    index = int(flag[5:]) if ":" in flag else (rank or 0)
    if flag != "cuda" and rank is not None:
        raise AuditError(f"--device {flag} under torchrun: every rank would use the same GPU; "
                         "pass --device cuda (each rank takes GPU LOCAL_RANK)")
    if index >= count:
        raise AuditError(f"--device cuda:{index}: only {count} CUDA device(s) visible"
                         + (" (rank's LOCAL_RANK exceeds the GPUs)" if ":" not in flag else ""))
    return torch.device("cuda", index)


def resolve_placement(device: str = "auto", dtype: str = "auto", device_map: str | None = None,
                      target_dir: str | Path | None = None, env=os.environ,
                      cuda_count: int | None = None) -> Placement:
    """The one place `--device`, `--dtype` and `--device-map` (values their declarations allow,
    dflash_audit/verb_flags.py) become a placement on this machine."""
    rank = local_rank(env)
    if device_map is not None:
        if rank is not None:
            raise AuditError("--device-map auto shards one target over every visible GPU, and under torchrun "
                             "each rank takes its own GPU (LOCAL_RANK): use one or the other")
        if device not in ("auto", "cuda"):
            raise AuditError(f"--device-map auto places the target itself; it does not go with --device {device}")
    resolved_device = resolve_device(device, rank, cuda_count)
    resolved_dtype, source = resolve_dtype(dtype, target_dir)
    return Placement(resolved_device, resolved_dtype, source, device_map)


# -- devices of models, never of a global ------------------------------------------------
def model_device(module: nn.Module) -> torch.device:
    """The device of a module's first parameter (a drafter lives on one device)."""
    return next(module.parameters()).device


def target_device(target: nn.Module) -> torch.device:
    """Where a (possibly sharded) target reads its input ids: its input embeddings' device."""
    return target.get_input_embeddings().weight.device


def model_dtype(module: nn.Module) -> torch.dtype:
    return next(module.parameters()).dtype


# The flags' help, one wording for every command.
DEVICE_HELP = "auto (CUDA when available) | cpu | cuda | cuda:N; under torchrun each rank takes GPU LOCAL_RANK"
DTYPE_HELP = "auto (the target's config.json dtype) | bfloat16 | float16 | float32; the drafters run in it too"
DEVICE_MAP_HELP = "auto: shard a target too large for one GPU over the GPUs, then the CPU (accelerate)"


def built_in(device: torch.device, dtype: torch.dtype, build):
    """`build()` with its new tensors made in `dtype` on `device`: a drafter made where and how it
    runs, no float32 copy first. Buffers its code computes in float32 on purpose (the rotary
    `inv_freq`) stay float32, as `from_pretrained(dtype=...)` leaves them; a cast afterwards
    (`.to(dtype)`) would round them too."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            return build()
    finally:
        torch.set_default_dtype(previous)


def built_for(target: nn.Module | None, build):
    """`build()` made where and in what dtype `target` runs (`built_in` its device and dtype): how an
    implementation builds the drafter it decodes with against `target`; float32 on the CPU without one."""
    if target is None:
        return built_in(torch.device("cpu"), torch.float32, build)
    return built_in(target_device(target), model_dtype(target), build)

"""The memory plan: before any target weight is read, what the dynamic audit will hold, and where.

Target bytes come from the parameter count of the target built on the meta device (no weights
read) in the placement's dtype; the drafters' from their specs the same way; the cache from
`impl.offline.cache.cache_bytes_estimate`; the workspace from the longest sequence (every
layer's output of the cache's full forward, the logits, the attention scores and the KV cache,
and the drafters' replay banks). When the sum does not fit the free device and host memory
the audit stops with one line that gives the numbers and the flag that fixes it, instead of
being killed for memory halfway through.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from foundation.errors import AuditError
from foundation.placement import Placement, dtype_name
from impl.offline.cache import cache_bytes_estimate
from impl.offline.walks import DEFAULT_PROMPT_GROUP

GB = 1e9


def itemsize(dtype: torch.dtype) -> int:
    return torch.finfo(dtype).bits // 8


def meta_bytes(build, dtype: torch.dtype) -> int:
    """Bytes of the floating-point parameters and buffers of `build()` in `dtype`, built on the meta device."""
    with torch.device("meta"):
        model = build()
    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()]}.values()  # tied weights once
    return sum(t.numel() * (itemsize(dtype) if t.is_floating_point() else t.element_size()) for t in tensors)


def target_bytes(config, dtype: torch.dtype) -> int:
    from transformers import AutoModelForCausalLM

    return meta_bytes(lambda: AutoModelForCausalLM.from_config(config), dtype)


def drafter_bytes(spec, dtype: torch.dtype) -> int:
    from impl.model import DFlashDrafter

    return meta_bytes(lambda: DFlashDrafter(spec), dtype)


@dataclass
class MemoryPlan:
    target: int
    drafters: int
    cache: int
    workspace: int
    dtype: torch.dtype

    @property
    def total(self) -> int:
        return self.target + self.drafters + self.cache + self.workspace

    def describe(self) -> str:
        return (f"target {self.target / GB:.2f} GB ({dtype_name(self.dtype)}) + drafters {self.drafters / GB:.2f} GB "
                f"+ cache {self.cache / GB:.2f} GB + workspace {self.workspace / GB:.2f} GB "
                f"= {self.total / GB:.2f} GB")


def plan_memory(config, dtype: torch.dtype, drafter_specs: list, prompt_lengths: list[int],
                max_new_tokens: int) -> MemoryPlan:
    """What the audit of `prompt_lengths` prompts against a target of `config` will hold."""
    size = itemsize(dtype)
    hidden, layers, vocab = config.hidden_size, config.num_hidden_layers, config.vocab_size
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    longest = max(prompt_lengths, default=0) + max_new_tokens
    tokens = sum(prompt_lengths) + max_new_tokens * len(prompt_lengths)
    workspace = (longest * (layers + 1) * hidden * size  # every layer's output of the cache's forward
                 + longest * vocab * (size + 4)  # its logits, and their float32 copy for the margins
                 + 2 * heads * longest * longest * size  # one layer's attention scores and weights
                 + 2 * layers * kv_heads * head_dim * longest * size)  # the KV cache
    # The cache keeps the union of the layers the audited drafters read.
    cache_layers = sorted({i for spec in drafter_specs for i in spec.target_layer_ids})
    group = min(len(prompt_lengths), DEFAULT_PROMPT_GROUP)
    for spec in drafter_specs:  # the replay's per-prompt context K/V banks
        workspace += 2 * spec.num_hidden_layers * group * spec.num_key_value_heads * spec.head_dim \
            * (longest + spec.block_size) * size
    return MemoryPlan(target=target_bytes(config, dtype),
                      drafters=sum(drafter_bytes(spec, dtype) for spec in drafter_specs),
                      cache=cache_bytes_estimate(tokens, cache_layers, hidden, dtype),
                      workspace=workspace, dtype=dtype)


def host_available(meminfo: str | Path = "/proc/meminfo") -> int | None:
    """MemAvailable in bytes, or None where the system does not say."""
    try:
        for line in Path(meminfo).read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def device_free(placement: Placement) -> list[int]:
    """Free bytes of each GPU the target may use: the placement's one, or every visible one when sharded."""
    if placement.device.type != "cuda":
        return []
    indices = range(torch.cuda.device_count()) if placement.device_map else [placement.device.index or 0]
    return [torch.cuda.mem_get_info(i)[0] for i in indices]


def check_plan(plan: MemoryPlan, placement: Placement, free_on_devices: list[int] | None = None,
               free_on_host: int | None = None, cuda_count: int | None = None) -> None:
    """AuditError (one line: the numbers and the flag that fixes it) when the plan does not fit.

    The free memory is a parameter so a test can hand in a small machine; by default it is read
    from the devices (`torch.cuda.mem_get_info`) and the host (`/proc/meminfo` MemAvailable).
    On a GPU the target, drafters and workspace sit on the device and the cache on the host;
    sharded, whatever the GPUs cannot hold goes to the host with the cache.
    """
    free_on_devices = device_free(placement) if free_on_devices is None else free_on_devices
    free_on_host = host_available() if free_on_host is None else free_on_host
    gpus = torch.cuda.device_count() if cuda_count is None else cuda_count
    on_device = plan.target + plan.drafters + plan.workspace
    if placement.device.type == "cpu":
        need_host, where = plan.total, "the host"
    elif placement.device_map:
        pool = sum(free_on_devices)
        need_host = plan.cache + max(0, on_device - pool)
        where = f"{len(free_on_devices)} GPU(s) have {pool / GB:.2f} GB free and the host"
    else:
        free = free_on_devices[0]
        if on_device > free:
            raise AuditError(refusal(plan, placement, f"{placement.device} has {free / GB:.2f} GB free "
                                     f"(target + drafters + workspace need {on_device / GB:.2f} GB there)", gpus))
        need_host, where = plan.cache, "the host (the cache)"
    if free_on_host is not None and need_host > free_on_host:
        raise AuditError(refusal(plan, placement, f"{where} has {free_on_host / GB:.2f} GB available "
                                 f"and needs {need_host / GB:.2f} GB", gpus))


def refusal(plan: MemoryPlan, placement: Placement, shortfall: str, gpus: int) -> str:
    fixes = []
    if gpus and not placement.device_map:
        fixes.append("--device-map auto (shards the target over the GPUs, then the CPU)")
    if plan.dtype == torch.float32:
        fixes.append("--dtype bfloat16 (halves the target, cache and workspace)")
    if plan.cache >= plan.total / 4:
        fixes.append("fewer prompts or a lower --max-new-tokens (the cache)")
    if not fixes:
        fixes.append("fewer prompts or a lower --max-new-tokens")
    return f"memory plan does not fit: {plan.describe()}, but {shortfall}; try {' or '.join(fixes)}"

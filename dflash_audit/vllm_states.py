"""`--hidden-states vllm`: the dynamic audit's offline cache made by vLLM's `extract_hidden_states` instead of the
transformers pass (serving_engines/live/hidden_states.py runs it), for a target served with tensor parallelism.

The cache keeps, per z-lab layer id, what `context_features` reads: the raw output of that decoder layer, and for the
last layer its output after the final norm. vLLM captures depths (dflash_audit/data_check/claims.py): z-lab id i is
depth i + 1, and the last layer after the norm is vLLM's own final norm applied to depth N (the driver does it in the
engine). vLLM's own files stay beside the cache (`<key>.records/`), in the format its connector writes, so
`data-check` reads them (`--layer-ids` = the depths in `driver.json`).
"""

from __future__ import annotations

from pathlib import Path

import torch

from foundation.placement import dtype_name
from impl.offline.cache import CachedPrompt, HiddenStateCache, target_dtype
from impl.layers import hidden_state_index, names_final_layer


def depths_for(layer_ids: list[int], layers: int) -> list[int]:
    """vLLM depths for the cache's z-lab layer ids: each id's output, and the last layer (before its norm) always."""
    return sorted({hidden_state_index(i) for i in layer_ids if not names_final_layer(i, layers)} | {layers})

class VllmCacheBuilder:
    """Builds an offline cache through vLLM (`impl.offline.load_or_build_cache(builder=...)`)."""

    name = "vllm"

    def __init__(self, target_dir: Path, vllm_python: Path | None = None, tensor_parallel_size: int = 1):
        self.target_dir = Path(target_dir)
        self.vllm_python = vllm_python
        self.tensor_parallel_size = tensor_parallel_size
        self.facts: dict = {}

    def __call__(self, *, key: str, folder: Path, target, prompts, layer_ids: list[int], max_new_tokens: int,
                 stop_token_ids: list[int]) -> HiddenStateCache:
        from serving_engines.live.hidden_states import extract_hidden_states
        from serving_engines.live.vllm_env import find_vllm

        layers = target.config.num_hidden_layers
        depths = depths_for(layer_ids, layers)
        dtype = target_dtype(target)
        records, result = extract_hidden_states(
            find_vllm(self.vllm_python), self.target_dir,
            [{"id": prompt_id, "ids": ids.reshape(-1).tolist()} for prompt_id, ids in prompts], depths,
            max_new_tokens, list(stop_token_ids), dtype_name(dtype), Path(folder), self.tensor_parallel_size)
        self.facts = {key: result[key] for key in ("vllm_version", "path", "load_s", "generate_s", "wall_s",
                                                   "connector_stopped_at") if key in result}
        self.facts.update(records=str(folder), depths=depths)
        entries = []
        for record in records:
            states = {}
            for layer_id in layer_ids:
                state = record.normed if names_final_layer(layer_id, layers) else record.hidden[:, depths.index(hidden_state_index(layer_id))]
                states[layer_id] = state.to(dtype).contiguous()
            entries.append(CachedPrompt(record.id, record.token_ids, record.prompt_len, states, record.margin))
        return HiddenStateCache(key=key, max_new_tokens=max_new_tokens, stop_token_ids=list(stop_token_ids),
                                prompts=entries)

def cache_builder(target: Path, vllm_python: Path | None, tensor_parallel_size: int) -> VllmCacheBuilder:
    """The vLLM builder of `compare --hidden-states vllm` (its flags validated by `CompareFlags`)."""
    return VllmCacheBuilder(target, vllm_python, tensor_parallel_size)

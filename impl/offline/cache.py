"""The hidden-state cache: every decoder layer's output for a prompt and its greedy
continuation, computed once per (target, prompts, settings) and kept as safetensors.

The cache holds every decoder layer's output (layer i at row i), so drafters reading
different target layers share one cache.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from impl.cache_dir import build_once
from impl.checkpoint import atomic_write_bytes
from impl.decoding import greedy_decode
from impl.extract import HiddenStateExtractor, decoder_layers

CACHE_FORMAT = "dflash-audit/offline-1"


@dataclass
class CachedPrompt:
    id: str
    token_ids: torch.Tensor  # [T] prompt + greedy continuation
    prompt_len: int
    hidden_states: torch.Tensor  # [N, T, H]: row i = the output of decoder layer i, as `context_features` reads it
    final_raw: torch.Tensor  # [T, H] raw output of the last decoder layer
    margin: torch.Tensor  # [T] top-1 minus top-2 target logit at each position

    def features(self, layer_ids: list[int]) -> torch.Tensor:
        """The drafter's context features [1, T, len(ids) * H]."""
        return torch.cat([self.hidden_states[i] for i in layer_ids], dim=-1)[None]


@dataclass
class HiddenStateCache:
    key: str
    max_new_tokens: int
    stop_token_ids: list[int]
    prompts: list[CachedPrompt]

    def save(self, path: str | Path) -> None:
        tensors, index = {}, []
        for i, p in enumerate(self.prompts):
            for name in ("token_ids", "hidden_states", "final_raw", "margin"):
                tensors[f"{i}.{name}"] = getattr(p, name).contiguous()
            index.append({"id": p.id, "prompt_len": p.prompt_len})
        meta = {"format": CACHE_FORMAT, "key": self.key, "max_new_tokens": str(self.max_new_tokens),
                "stop_token_ids": json.dumps(self.stop_token_ids), "prompts": json.dumps(index)}
        atomic_write_bytes(Path(path), lambda tmp: save_file(tensors, tmp, metadata=meta))

    @classmethod
    def load(cls, path: str | Path) -> HiddenStateCache:
        with safe_open(str(path), framework="pt") as handle:
            meta = handle.metadata() or {}
            if meta.get("format") != CACHE_FORMAT:
                raise ValueError(f"{path}: not an offline hidden-state cache ({CACHE_FORMAT})")
            prompts = [CachedPrompt(id=item["id"], prompt_len=int(item["prompt_len"]),
                                    **{name: handle.get_tensor(f"{i}.{name}")
                                       for name in ("token_ids", "hidden_states", "final_raw", "margin")})
                       for i, item in enumerate(json.loads(meta["prompts"]))]
        return cls(key=meta["key"], max_new_tokens=int(meta["max_new_tokens"]),
                   stop_token_ids=json.loads(meta["stop_token_ids"]), prompts=prompts)


def cache_bytes_estimate(num_tokens: int, layer_ids, hidden_size: int, dtype: torch.dtype) -> int:
    """Bytes the cache holds for `num_tokens` tokens (prompts + continuations): per token, the
    states of `layer_ids` and the raw final state in `dtype`, its id (int64) and margin (float32)."""
    itemsize = torch.finfo(dtype).bits // 8
    return num_tokens * ((len(list(layer_ids)) + 1) * hidden_size * itemsize + 8 + 4)


# -- building the cache ------------------------------------------------------------------
def cache_key(target_dir: str | Path, prompt_ids: list[list[int]], max_new_tokens: int,
              stop_token_ids: list[int], dtype: torch.dtype = torch.float32) -> str:
    """Hash of the target's files, the tokenized prompts, the generation settings and the dtype
    the target ran in (a bfloat16 cache is not a float32 one)."""
    digest = hashlib.sha256(CACHE_FORMAT.encode())
    for file in sorted(p for p in Path(target_dir).rglob("*") if p.is_file()):
        digest.update(file.relative_to(target_dir).as_posix().encode())
        with file.open("rb") as handle:
            for chunk in iter(lambda: handle.read(1 << 20), b""):
                digest.update(chunk)
    settings = {"prompts": prompt_ids, "max_new_tokens": max_new_tokens, "stop": sorted(stop_token_ids),
                "dtype": str(dtype)}
    digest.update(json.dumps(settings).encode())
    return digest.hexdigest()[:24]


@torch.inference_mode()
def cache_prompt(target: nn.Module, prompt_id: str, input_ids: torch.Tensor, max_new_tokens: int,
                 stop_token_ids: list[int]) -> CachedPrompt:
    """Greedy continuation, then one forward over prompt + continuation (the extractor every
    implementation uses: the same layer indexing and the same raw final-layer output)."""
    token_ids = greedy_decode(target, input_ids, max_new_tokens, stop_token_ids)
    num_layers = len(decoder_layers(target))
    states = HiddenStateExtractor(target, list(range(num_layers)))(token_ids, with_logits=True)
    length = token_ids.shape[1]
    top2 = states.logits[0].float().topk(2, dim=-1).values
    return CachedPrompt(id=prompt_id, token_ids=token_ids[0].cpu(), prompt_len=input_ids.shape[1],
                        hidden_states=states.context[0].view(length, num_layers, -1).transpose(0, 1).contiguous().cpu(),
                        final_raw=states.final_raw[0].cpu(), margin=(top2[:, 0] - top2[:, 1]).cpu())


def load_or_build_cache(cache_dir: str | Path, target_dir: str | Path, target: nn.Module,
                        prompts: list[tuple[str, torch.Tensor]], max_new_tokens: int,
                        stop_token_ids: list[int], on_prompt=None) -> HiddenStateCache:
    """The cache for (target, prompts, settings): read from `cache_dir` or built once and written there."""
    key = cache_key(target_dir, [ids[0].tolist() for _, ids in prompts], max_new_tokens, stop_token_ids,
                    next(target.parameters()).dtype)
    path = Path(cache_dir) / f"{key}.safetensors"

    def build() -> HiddenStateCache:
        entries = []
        for prompt_id, ids in prompts:
            entries.append(cache_prompt(target, prompt_id, ids, max_new_tokens, stop_token_ids))
            if on_prompt is not None:
                on_prompt()
        cache = HiddenStateCache(key=key, max_new_tokens=max_new_tokens, stop_token_ids=list(stop_token_ids),
                                 prompts=entries)
        cache.save(path)
        return cache

    return build_once(path.with_suffix(".lock"), lambda: HiddenStateCache.load(path) if path.is_file() else None,
                      build)



"""The hidden-state cache: the target's greedy continuation of each prompt and the outputs of
the target layers the audited drafters read, computed once per (target, prompts, settings).

On disk, under the cache folder:
  `<key>.safetensors`           the continuations (token ids, the target's top-2 margin per position)
  `<key>.layers/<id>.safetensors` one file per kept layer: that layer's states of every prompt

Only the union of the layer ids asked for is kept, in the target's own dtype (never upcast).
A later drafter reading other layers extends the cache: the missing layers are captured by
replaying the cached continuations through the same forwards (`capture.py`), the rest is read.
Every file is written atomically; whoever holds the cache's lock builds or extends it.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from foundation.atomic import atomic_write_bytes
from foundation.cache_dir import build_once
from foundation.inputs import openable
from foundation.placement import target_device
from impl.extract import decoder_layers
from impl.layers import layers_outside
from impl.offline.capture import DEFAULT_BATCH, capture
from impl.offline.speculative import capture_speculative

CACHE_FORMAT = "dflash-audit/offline-2"
TOKEN_BYTES = 8 + 4  # per position besides the states: the int64 token id and the float32 margin


@dataclass
class CachedPrompt:
    id: str
    token_ids: torch.Tensor  # [T] prompt + greedy continuation
    prompt_len: int
    layers: dict[int, torch.Tensor]  # layer id -> [T, H], as `context_features` reads it, in the target's dtype
    margin: torch.Tensor  # [T] top-1 minus top-2 target logit at each position

    def features(self, layer_ids: list[int]) -> torch.Tensor:
        """The drafter's context features [1, T, len(ids) * H]."""
        missing = [i for i in layer_ids if i not in self.layers]
        if missing:
            raise KeyError(f"the cache of prompt {self.id} holds layers {sorted(self.layers)}, not {missing}")
        return torch.cat([self.layers[i] for i in layer_ids], dim=-1)[None]


@dataclass
class HiddenStateCache:
    key: str
    max_new_tokens: int
    stop_token_ids: list[int]
    prompts: list[CachedPrompt]

    @property
    def layer_ids(self) -> list[int]:
        return sorted(self.prompts[0].layers) if self.prompts else []

    def save(self, path: str | Path) -> None:
        """The continuations to `path`, each layer to `<path stem>.layers/<id>.safetensors` (layers first:
        the continuation file is the last to appear)."""
        path = Path(path)
        for layer_id in self.layer_ids:
            save_layer(path, layer_id, [p.layers[layer_id] for p in self.prompts])
        tensors, index = {}, []
        for i, p in enumerate(self.prompts):
            tensors[f"{i}.token_ids"], tensors[f"{i}.margin"] = p.token_ids.contiguous(), p.margin.contiguous()
            index.append({"id": p.id, "prompt_len": p.prompt_len})
        meta = {"format": CACHE_FORMAT, "key": self.key, "max_new_tokens": str(self.max_new_tokens),
                "stop_token_ids": json.dumps(self.stop_token_ids), "prompts": json.dumps(index)}
        atomic_write_bytes(path, lambda tmp: save_file(tensors, tmp, metadata=meta))

    @classmethod
    def load(cls, path: str | Path, layer_ids: list[int] | None = None) -> HiddenStateCache:
        """The continuations and the layers `layer_ids` (default: every kept layer)."""
        path = Path(path)
        with safe_open(openable(path), framework="pt") as handle:
            meta = handle.metadata() or {}
            if meta.get("format") != CACHE_FORMAT:
                raise ValueError(f"{path}: not an offline hidden-state cache ({CACHE_FORMAT})")
            prompts = [CachedPrompt(id=item["id"], prompt_len=int(item["prompt_len"]),
                                    token_ids=handle.get_tensor(f"{i}.token_ids"), layers={},
                                    margin=handle.get_tensor(f"{i}.margin"))
                       for i, item in enumerate(json.loads(meta["prompts"]))]
        for layer_id in kept_layers(path) if layer_ids is None else layer_ids:
            with safe_open(openable(layer_path(path, layer_id)), framework="pt") as handle:
                for i, prompt in enumerate(prompts):
                    prompt.layers[layer_id] = handle.get_tensor(str(i))
        return cls(key=meta["key"], max_new_tokens=int(meta["max_new_tokens"]),
                   stop_token_ids=json.loads(meta["stop_token_ids"]), prompts=prompts)


def unreadable(path: Path) -> str | None:
    """What is wrong with the cache at `path` (a file cut short by a full disk or a copy, a foreign file), or
    None. safetensors checks each header against the file's length on opening: no tensor is read."""
    for file in [path] + [layer_path(path, i) for i in kept_layers(path)]:
        try:
            with safe_open(openable(file), framework="pt") as handle:
                if (handle.metadata() or {}).get("format") != CACHE_FORMAT:
                    return f"{file.name} is not a {CACHE_FORMAT} file"
        except Exception as exc:  # noqa: BLE001 -- safetensors' own error type: any failure to open is damage
            return f"{file.name} is truncated or corrupt: {' '.join(str(exc).split())[:120]}"
    return None


def discard(path: Path) -> None:
    """Remove a damaged cache entry (the tool's own files, under its cache folder) before rebuilding it."""
    path.unlink(missing_ok=True)
    shutil.rmtree(path.with_suffix(".layers"), ignore_errors=True)
    shutil.rmtree(path.with_suffix(".records"), ignore_errors=True)  # another engine's own records (`builder`)


def layer_path(path: Path, layer_id: int) -> Path:
    return path.with_suffix(".layers") / f"{layer_id}.safetensors"


def kept_layers(path: Path) -> list[int]:
    folder = path.with_suffix(".layers")
    return sorted(int(p.stem) for p in folder.glob("*.safetensors") if p.stem.isdigit()) if folder.is_dir() else []


def save_layer(path: Path, layer_id: int, states: list[torch.Tensor]) -> None:
    tensors = {str(i): s.contiguous() for i, s in enumerate(states)}
    target = layer_path(path, layer_id)
    target.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(target, lambda tmp: save_file(tensors, tmp, metadata={"format": CACHE_FORMAT}))


def cache_bytes_estimate(num_tokens: int, layer_ids, hidden_size: int, dtype: torch.dtype) -> int:
    """Bytes of a cache of `num_tokens` positions (prompts + continuations, all prompts) keeping
    `layer_ids` in `dtype`: the states plus each position's token id and margin."""
    return num_tokens * (len(set(layer_ids)) * hidden_size * dtype.itemsize + TOKEN_BYTES)


# -- building the cache ------------------------------------------------------------------
def cache_key(target_dir: str | Path, prompt_ids: list[list[int]], max_new_tokens: int,
              stop_token_ids: list[int], dtype: torch.dtype = torch.float32, device_type: str = "cpu") -> str:
    """Hash of the target's files, the tokenized prompts, the generation settings and the numerics
    the target runs in (its dtype and device type decide near-ties of the greedy continuation)."""
    digest = hashlib.sha256(CACHE_FORMAT.encode())
    for file in sorted(p for p in Path(target_dir).rglob("*") if p.is_file()):
        digest.update(file.relative_to(target_dir).as_posix().encode())
        with file.open("rb") as handle:
            for chunk in iter(lambda: handle.read(1 << 20), b""):
                digest.update(chunk)
    settings = {"prompts": prompt_ids, "max_new_tokens": max_new_tokens, "stop": sorted(stop_token_ids),
                "numerics": [str(dtype), device_type]}
    digest.update(json.dumps(settings).encode())
    return digest.hexdigest()[:24]


def target_dtype(target: nn.Module) -> torch.dtype:
    return target.get_input_embeddings().weight.dtype


def build_cache(key: str, target: nn.Module, prompts: list[tuple[str, torch.Tensor]], layer_ids: list[int],
                max_new_tokens: int, stop_token_ids: list[int], batch: int = DEFAULT_BATCH,
                on_prompt=None, drafter=None) -> HiddenStateCache:
    """Greedy continuations of `prompts` with the states of `layer_ids` captured on the way: `batch`
    prompts per target forward, or with `drafter` one prompt at a time by speculative decoding."""
    if drafter is None:
        captured = capture(target, [ids.reshape(-1) for _, ids in prompts], layer_ids, max_new_tokens,
                           stop_token_ids, batch=batch, on_prompt=on_prompt)
    else:
        captured = []
        for _, ids in prompts:
            captured.append(capture_speculative(target, drafter, ids.reshape(-1), layer_ids, max_new_tokens,
                                                stop_token_ids)[0])
            if on_prompt is not None:
                on_prompt(len(captured[-1].token_ids) - captured[-1].prompt_len)
    entries = [CachedPrompt(prompt_id, c.token_ids, c.prompt_len, c.layers, c.margin)
               for (prompt_id, _), c in zip(prompts, captured)]
    return HiddenStateCache(key=key, max_new_tokens=max_new_tokens, stop_token_ids=list(stop_token_ids),
                            prompts=entries)


def extend_cache(path: Path, target: nn.Module, layer_ids: list[int], batch: int = DEFAULT_BATCH,
                 on_prompt=None) -> None:
    """Add the layers of `layer_ids` the cache at `path` lacks, from its own continuations."""
    cache = HiddenStateCache.load(path, [])
    missing = sorted(set(layer_ids) - set(kept_layers(path)))
    if not missing:
        return
    captured = capture(target, [p.token_ids[:p.prompt_len] for p in cache.prompts], missing, cache.max_new_tokens,
                       cache.stop_token_ids, forced=[p.token_ids for p in cache.prompts], batch=batch,
                       on_prompt=on_prompt)
    for layer_id in missing:
        save_layer(path, layer_id, [c.layers[layer_id] for c in captured])


def load_or_build_cache(cache_dir: str | Path, target_dir: str | Path, target: nn.Module,
                        prompts: list[tuple[str, torch.Tensor]], max_new_tokens: int,
                        stop_token_ids: list[int], layer_ids=None, on_prompt=None,
                        batch: int = DEFAULT_BATCH, drafter=None, notify=None, builder=None) -> HiddenStateCache:
    """The cache for (target, prompts, settings) holding at least `layer_ids` (default: every
    layer): read from `cache_dir`, extended there with the layers it lacks, or built once
    (by speculative decoding with `drafter` when one is given: the same greedy continuation).

    `builder` (another engine's pass, e.g. vLLM's: `builder.name` joins the key, so its cache is its own) builds the
    whole cache instead (`builder(key=, folder=, target=, prompts=, layer_ids=, max_new_tokens=, stop_token_ids=)`, its
    own records kept in `folder`); one short of layers is built again with them all."""
    notify = notify or (lambda line: print(line, file=sys.stderr))
    num_layers = len(decoder_layers(target))
    wanted = sorted(set(range(num_layers) if layer_ids is None else layer_ids))
    outside = layers_outside(wanted, num_layers)
    if outside:
        raise ValueError(f"layer ids {outside}")
    device_type = target_device(target).type if builder is None else f"{builder.name}:{target_device(target).type}"
    key = cache_key(target_dir, [ids.reshape(-1).tolist() for _, ids in prompts], max_new_tokens, stop_token_ids,
                    target_dtype(target), device_type)
    path = Path(cache_dir) / f"{key}.safetensors"

    def found() -> HiddenStateCache | None:
        if path.is_file() and set(wanted) <= set(kept_layers(path)) and unreadable(path) is None:
            return HiddenStateCache.load(path, wanted)
        return None  # absent, short of layers, or damaged: built (or rebuilt) under the lock

    def build() -> HiddenStateCache:
        damage = unreadable(path) if path.is_file() else None
        if damage is not None:
            notify(f"the offline cache {path} is damaged ({damage}); rebuilding it")
            discard(path)
        if path.is_file() and builder is None:
            extend_cache(path, target, wanted, batch, on_prompt)
            return HiddenStateCache.load(path, wanted)
        if builder is not None:
            wanted_all = sorted(set(wanted) | set(kept_layers(path) if path.is_file() else []))
            discard(path)
        try:
            if builder is not None:
                cache = builder(key=key, folder=path.with_suffix(".records"), target=target, prompts=prompts,
                                layer_ids=wanted_all, max_new_tokens=max_new_tokens, stop_token_ids=stop_token_ids)
                cache.save(path)
                return cache
            cache = build_cache(key, target, prompts, wanted, max_new_tokens, stop_token_ids, batch, on_prompt,
                                drafter)
            cache.save(path)
        except BaseException:
            discard(path)  # a cache cut short (a full disk, an interrupt) is no cache: none of it stays
            raise
        return cache

    return build_once(path.with_suffix(".lock"), found, build)

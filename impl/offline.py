"""Offline τ: replay the DFlash and DDTree acceptance walks from cached target hidden states.

Greedy speculative decoding is lossless, so the live loop's output is the target's greedy
continuation, and the target's verdict at every position is already known: token t+1 of
that continuation. What a round accepts then depends only on the drafter's block at the
round's anchor, and that block depends only on the context features before the anchor.
So the target runs once per (target, prompts) — greedy continuation plus one forward over
prompt + continuation, cached on disk as safetensors — and each drafter is evaluated at
*every* candidate anchor in a few batched passes (each block sees its own context
prefix through a mask), after which the walks are pure bookkeeping.

The cache holds every decoder layer's hidden states (`hs[1:]`, as Hugging Face returns
them), so drafters reading different target layers share one cache.
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

from impl.checkpoint import atomic_write_bytes
from impl.ddtree import build_tree
from impl.decoding import greedy_decode
from impl.extract import HIDDEN_STATES_OFFSET, decoder_layers, output_head
from impl.masks import inference_mask
from impl.model import DFlashDrafter

CACHE_FORMAT = "dflash-audit/offline-1"
DEFAULT_ANCHOR_CHUNK = 64  # blocks per batched drafter pass; bounds the attention matrix


@dataclass
class CachedPrompt:
    id: str
    token_ids: torch.Tensor  # [T] prompt + greedy continuation
    prompt_len: int
    hidden_states: torch.Tensor  # [N, T, H]: hs[1..N] of one full forward (hs[N] is post-norm in transformers 5)
    final_raw: torch.Tensor  # [T, H] raw output of the last decoder layer
    margin: torch.Tensor  # [T] top-1 minus top-2 target logit at each position

    def features(self, layer_ids: list[int]) -> torch.Tensor:
        """The drafter's context features [1, T, len(ids) * H] (z-lab indexing: hs[id + 1])."""
        return torch.cat([self.hidden_states[i + HIDDEN_STATES_OFFSET - 1] for i in layer_ids], dim=-1)[None]


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


# -- building the cache ------------------------------------------------------------------
def cache_key(target_dir: str | Path, prompt_ids: list[list[int]], max_new_tokens: int,
              stop_token_ids: list[int]) -> str:
    """Hash of the target's files, the tokenized prompts and the generation settings."""
    digest = hashlib.sha256(CACHE_FORMAT.encode())
    for file in sorted(p for p in Path(target_dir).rglob("*") if p.is_file()):
        digest.update(file.relative_to(target_dir).as_posix().encode())
        with file.open("rb") as handle:
            for chunk in iter(lambda: handle.read(1 << 20), b""):
                digest.update(chunk)
    settings = {"prompts": prompt_ids, "max_new_tokens": max_new_tokens, "stop": sorted(stop_token_ids)}
    digest.update(json.dumps(settings).encode())
    return digest.hexdigest()[:24]


@torch.inference_mode()
def cache_prompt(target: nn.Module, prompt_id: str, input_ids: torch.Tensor, max_new_tokens: int,
                 stop_token_ids: list[int]) -> CachedPrompt:
    """Greedy continuation, then one forward over prompt + continuation."""
    token_ids = greedy_decode(target, input_ids, max_new_tokens, stop_token_ids)
    captured = {}
    hook = decoder_layers(target)[-1].register_forward_hook(
        lambda _m, _i, output: captured.setdefault("raw", output[0] if isinstance(output, tuple) else output))
    try:
        out = target(token_ids, output_hidden_states=True, use_cache=False)
    finally:
        hook.remove()
    top2 = out.logits[0].float().topk(2, dim=-1).values
    return CachedPrompt(id=prompt_id, token_ids=token_ids[0].cpu(), prompt_len=input_ids.shape[1],
                        hidden_states=torch.stack([h[0] for h in out.hidden_states[1:]]).cpu(),
                        final_raw=captured["raw"][0].cpu(), margin=(top2[:, 0] - top2[:, 1]).cpu())


def load_or_build_cache(cache_dir: str | Path, target_dir: str | Path, target: nn.Module,
                        prompts: list[tuple[str, torch.Tensor]], max_new_tokens: int,
                        stop_token_ids: list[int], on_prompt=None) -> HiddenStateCache:
    """The cache for (target, prompts, settings): read from `cache_dir` or built once and written there."""
    key = cache_key(target_dir, [ids[0].tolist() for _, ids in prompts], max_new_tokens, stop_token_ids)
    path = Path(cache_dir) / f"{key}.safetensors"
    if path.is_file():
        return HiddenStateCache.load(path)
    entries = []
    for prompt_id, ids in prompts:
        entries.append(cache_prompt(target, prompt_id, ids, max_new_tokens, stop_token_ids))
        if on_prompt is not None:
            on_prompt()
    cache = HiddenStateCache(key=key, max_new_tokens=max_new_tokens, stop_token_ids=list(stop_token_ids),
                             prompts=entries)
    cache.save(path)
    return cache


# -- batched drafter passes --------------------------------------------------------------
def replay_mask(anchors: torch.Tensor, context_len: int, block_len: int, window: int | None,
                causal: bool) -> torch.Tensor:
    """[A*S, T + A*S] bool: block j (anchor a_j) sees context positions < a_j and its own block only.

    Per block this is exactly `inference_mask(a_j, S, ...)` laid out over the shared keys.
    """
    slots = torch.arange(block_len)
    q_pos = (anchors[:, None] + slots[None, :]).reshape(-1, 1)  # [A*S, 1]
    anchor_of_query = anchors.repeat_interleave(block_len)[:, None]
    k_pos = torch.arange(context_len)[None, :]
    sees_context = k_pos < anchor_of_query
    if window is not None:
        sees_context &= q_pos - k_pos < window
    in_block = inference_mask(0, block_len, sliding_window=window, causal=causal)
    sees_blocks = torch.kron(torch.eye(anchors.numel(), dtype=torch.long), in_block.long()).bool()
    return torch.cat([sees_context, sees_blocks], dim=1)


@torch.inference_mode()
def block_logits(drafter: DFlashDrafter, target: nn.Module, entry: CachedPrompt, anchors: torch.Tensor,
                 block_len: int, chunk: int = DEFAULT_ANCHOR_CHUNK) -> torch.Tensor:
    """The drafter's logits for slots 1.. of the block at each anchor: [A, block_len - 1, V]."""
    features = entry.features(drafter.target_layer_ids).to(next(drafter.parameters()).dtype)
    context_len = entry.token_ids.numel()
    head, out = output_head(target), []
    for part in anchors.split(chunk):
        block = torch.full((part.numel(), block_len), drafter.mask_token_id, dtype=torch.long)
        block[:, 0] = entry.token_ids[part]
        positions = torch.cat([torch.arange(context_len), (part[:, None] + torch.arange(block_len)).reshape(-1)])
        masks = drafter.layer_masks(lambda window, causal: replay_mask(part, context_len, block_len, window, causal))
        hidden = drafter(drafter.embed(target, block.reshape(1, -1)), features, positions[None], masks=masks)
        hidden = hidden.view(part.numel(), block_len, -1)[:, 1:]
        out.append(drafter.compute_logits(hidden, head))
    return torch.cat(out)


class AnchorPredictions:
    """The drafter's per-depth logits at every anchor a round could start from."""

    def __init__(self, drafter: DFlashDrafter, target: nn.Module, entry: CachedPrompt, max_new_tokens: int,
                 chunk: int = DEFAULT_ANCHOR_CHUNK):
        self.last = entry.token_ids.numel() - 1  # rounds start at anchors prompt_len .. last - 1
        max_length = entry.prompt_len + max_new_tokens
        anchors = torch.arange(entry.prompt_len, self.last)
        # Near max_length the live loop shrinks the block (min(B, max_length - start)); the
        # drafter's full-attention layers see the whole block, so those anchors get their own size.
        sizes = torch.clamp(max_length - anchors, max=drafter.block_size)
        self.logits: dict[int, torch.Tensor] = {}
        for size in sizes.unique().tolist():
            group = anchors[sizes == size]
            for anchor, logits in zip(group.tolist(), block_logits(drafter, target, entry, group, size, chunk)):
                self.logits[anchor] = logits


def dflash_walk(entry: CachedPrompt, predictions: AnchorPredictions) -> list[int]:
    """Per-round acceptance lengths of greedy DFlash, replayed from the cached continuation."""
    tokens, last = entry.token_ids.tolist(), predictions.last
    start, rounds = entry.prompt_len, []
    while start < last:
        proposals = predictions.logits[start].argmax(-1).tolist()
        accepted = 0
        while accepted < min(len(proposals), last - start - 1) and proposals[accepted] == tokens[start + 1 + accepted]:
            accepted += 1
        produced = min(accepted + 1, last - start)
        rounds.append(produced)
        start += produced
    return rounds


def ddtree_walk(entry: CachedPrompt, predictions: AnchorPredictions, budget: int) -> list[int]:
    """Per-round acceptance lengths of greedy DDTree, replayed from the cached continuation."""
    tokens, last = entry.token_ids.tolist(), predictions.last
    start, rounds = entry.prompt_len, []
    while start < last:
        logprobs = torch.log_softmax(predictions.logits[start].float(), dim=-1)
        tree = build_tree(tokens[start], logprobs, budget)
        # On the accepted path the target's choice after depth d is the continuation's token.
        target_choice = [tokens[start + d + 1] if start + d + 1 <= last else -1 for d in tree.depths]
        path = tree.walk(target_choice)
        produced = min(len(path), last - start)
        rounds.append(produced)
        start += produced
    return rounds


def offline_rounds(drafter: DFlashDrafter, target: nn.Module, cache: HiddenStateCache, entry: CachedPrompt,
                   method: str = "dflash", budget: int | None = None) -> list[int]:
    predictions = AnchorPredictions(drafter, target, entry, cache.max_new_tokens)
    if method == "dflash":
        return dflash_walk(entry, predictions)
    if method == "ddtree":
        if budget is None:
            raise ValueError("ddtree needs a node budget")
        return ddtree_walk(entry, predictions, budget)
    raise ValueError(f"unknown method {method!r}; expected dflash or ddtree")


# -- agreement with the live loops -------------------------------------------------------
@dataclass
class Mismatch:
    prompt_id: str
    round: int
    position: int  # where the target's decision differs or the walks part
    margin: float  # the target's top-1 minus top-2 logit there: small = near-tie

    def describe(self) -> str:
        return (f"prompt {self.prompt_id}: round {self.round} differs at position {self.position} "
                f"(target top-2 logit margin {self.margin:.3g})")


def find_mismatch(entry: CachedPrompt, offline: list[int], live: list[int],
                  live_output_ids: torch.Tensor | None = None) -> Mismatch | None:
    """The first place the offline replay and a live run disagree, with the target's margin there."""
    if live_output_ids is not None:
        live_tokens, cached = live_output_ids.reshape(-1).tolist(), entry.token_ids.tolist()
        differ = [i for i, (a, b) in enumerate(zip(live_tokens, cached)) if a != b]
        if differ or len(live_tokens) != len(cached):
            position = differ[0] if differ else min(len(live_tokens), len(cached))
            decided_at = max(position - 1, 0)  # logits at t decide token t + 1
            return Mismatch(entry.id, _round_at(entry.prompt_len, live, decided_at), decided_at,
                            float(entry.margin[min(decided_at, entry.margin.numel() - 1)]))
    start = entry.prompt_len
    for i, (a, b) in enumerate(zip(offline, live)):
        if a != b:
            position = start + min(a, b) - 1  # the last position both agree was decided before it
            return Mismatch(entry.id, i, position, float(entry.margin[position]))
        start += a
    if len(offline) != len(live):
        return Mismatch(entry.id, min(len(offline), len(live)), start, float(entry.margin[min(start, entry.margin.numel() - 1)]))
    return None


def _round_at(prompt_len: int, rounds: list[int], position: int) -> int:
    start = prompt_len
    for i, length in enumerate(rounds):
        if position < start + length:
            return i
        start += length
    return len(rounds)

"""Offline τ: replay the DFlash and DDTree acceptance walks from cached target hidden states.

Greedy speculative decoding is lossless, so the live loop's output is the target's greedy
continuation, and the target's verdict at every position is already known: token t+1 of
that continuation. What a round accepts then depends only on the drafter's block at the
round's anchor, and that block depends only on the context features before the anchor.
So the target runs once per (target, prompts) — greedy continuation plus one forward over
prompt + continuation, cached on disk as safetensors — and each drafter only replays its
own rounds: one batched pass per round for all prompts at once, over context K/V that is
projected once per prompt, each block attending to just the keys it may see.

The cache holds every decoder layer's hidden states (`hs[1:]`, as Hugging Face returns
them), so drafters reading different target layers share one cache.
"""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn
from transformers.models.qwen3.modeling_qwen3 import rotate_half

from impl.cache_dir import build_once
from impl.checkpoint import atomic_write_bytes
from impl.ddtree import build_tree
from impl.decoding import greedy_decode
from impl.extract import HIDDEN_STATES_OFFSET, decoder_layers, output_head
from impl.masks import inference_mask
from impl.model import DFlashDrafter

CACHE_FORMAT = "dflash-audit/offline-1"
DEFAULT_PROMPT_GROUP = 64  # prompts walked in lockstep; bounds the padded context K/V
DEFAULT_BATCH_BLOCKS = 8  # blocks per drafter pass while few prompts are left
DFLASH_EARLY_SLOTS = 2  # slots the LM head always reads; later ones only while all earlier match


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


# -- the drafter's blocks, batched across prompts ----------------------------------------
def block_key_mask(anchors: torch.Tensor, key_positions: torch.Tensor, sizes: torch.Tensor, block_len: int,
                   window: int | None, causal: bool) -> torch.Tensor:
    """[A, S, S + L] bool: what block j (anchor a_j, `sizes[j]` real slots) sees of its keys.

    Keys are the block's own S slots (`inference_mask` of one block; slots past the block's
    size are padding nobody sees), then the context positions `key_positions` [A, L]
    (visible when < a_j, and within the window on sliding layers). Per block this is exactly
    `inference_mask(a_j, sizes[j], ...)`, block and context swapped.
    """
    q_pos = anchors[:, None, None] + torch.arange(block_len)[None, :, None]  # [A, S, 1]
    k_pos = key_positions[:, None, :]
    sees_context = (k_pos >= 0) & (k_pos < anchors[:, None, None])
    if window is not None:
        sees_context = sees_context & (q_pos - k_pos < window)
    real_slot = torch.arange(block_len)[None, None, :] < sizes[:, None, None]
    sees_block = inference_mask(0, block_len, sliding_window=window, causal=causal)[None] & real_slot
    return torch.cat([sees_block.expand(len(anchors), -1, -1), sees_context.expand(-1, block_len, -1)], dim=-1)


def replay_mask(anchors: torch.Tensor, context_len: int, block_len: int, window: int | None,
                causal: bool) -> torch.Tensor:
    """[A*S, T + A*S] bool: `block_key_mask` laid out over shared keys [context | all blocks].

    The mask one `DFlashDrafter.forward` over all blocks would need; `BlockReplay` gives
    each block only its own keys instead.
    """
    positions = torch.arange(context_len).expand(anchors.numel(), -1)
    sizes = torch.full_like(anchors, block_len)
    mask = block_key_mask(anchors, positions, sizes, block_len, window, causal)
    return torch.cat([mask[..., block_len:].reshape(-1, context_len), torch.block_diag(*mask[..., :block_len])],
                     dim=1)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + rotate_half(x) * sin


def _rms(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A Qwen3 RMSNorm as one fused op where that is bit-identical (fp32); the module itself otherwise."""
    if x.dtype != torch.float32:
        return norm(x)
    return F.rms_norm(x, (x.shape[-1],), norm.weight, norm.variance_epsilon)


class BlockReplay:
    """`DFlashDrafter.forward` for blocks of several cached prompts at once, each at its own anchor.

    Every prompt's context (fc, hidden_norm, each layer's K/V with rotary) is projected once
    into a per-layer bank `[P, kv, B + T_max, d]`: the first B rows take the current block's
    K/V, then context position t sits at row B + t. A block attends to exactly the keys
    `inference_mask` allows: its own slots and its prompt's context before the anchor (a
    gathered window on sliding layers). Keys past the furthest anchor are cut off, not just
    masked, and banks of finished prompts are dropped (`keep`), so nothing is copied per
    step while every prompt drafts one block.
    """

    def __init__(self, drafter: DFlashDrafter, target: nn.Module, entries: list[CachedPrompt]):
        self.drafter, self.target = drafter, target
        self.tokens = [entry.token_ids.tolist() for entry in entries]
        self.bank_row = {p: p for p in range(len(entries))}  # prompt -> row of the banks
        dtype = next(drafter.parameters()).dtype
        block_len = drafter.block_size
        context_len = max(len(ids) for ids in self.tokens)
        cos, sin = drafter.rotary_emb(torch.empty(0, dtype=dtype), torch.arange(context_len + block_len)[None])
        self.cos, self.sin = cos[0], sin[0]  # [T + B, d], indexed by position
        # Rows past a prompt's end lie past every anchor of that prompt: never seen.
        self.keys = [torch.zeros(len(entries), layer.self_attn.kv_heads, block_len + context_len,
                                 layer.self_attn.head_dim, dtype=dtype) for layer in drafter.layers]
        self.values = [torch.zeros_like(k) for k in self.keys]
        for p, entry in enumerate(entries):
            context = drafter.hidden_norm(drafter.fc(entry.features(drafter.target_layer_ids).to(dtype)))[0]
            length = context.shape[0]
            rows = slice(block_len, block_len + length)
            for layer, keys, values in zip(drafter.layers, self.keys, self.values):
                attn = layer.self_attn
                k = attn.k_norm(attn.k_proj(context).view(length, attn.kv_heads, attn.head_dim))
                keys[p, :, rows] = _rotate(k, self.cos[:length, None], self.sin[:length, None]).transpose(0, 1)
                values[p, :, rows] = attn.v_proj(context).view(length, attn.kv_heads, attn.head_dim).transpose(0, 1)

    def keep(self, prompts: list[int]) -> None:
        """Drop the banks of every prompt not in `prompts` (finished walks)."""
        if len(prompts) == len(self.bank_row):
            return
        rows = torch.tensor([self.bank_row[p] for p in prompts])
        self.keys = [k[rows] for k in self.keys]
        self.values = [v[rows] for v in self.values]
        self.bank_row = {p: i for i, p in enumerate(prompts)}

    def hidden(self, prompts: torch.Tensor, anchors: torch.Tensor, sizes: torch.Tensor) -> torch.Tensor:
        """Final-norm hidden states [A, B - 1, H] of slots 1.. of the block of `prompts[j]` at
        `anchors[j]` with `sizes[j]` slots (slot 0 holds the known token: no one reads its output)."""
        drafter, block_len = self.drafter, self.drafter.block_size
        block = torch.full((anchors.numel(), block_len), drafter.mask_token_id, dtype=torch.long)
        block[:, 0] = torch.tensor([self.tokens[p][a] for p, a in zip(prompts.tolist(), anchors.tolist())])
        slot_positions = anchors[:, None] + torch.arange(block_len)[None]  # [A, S]
        cos, sin = self.cos[slot_positions][:, :, None], self.sin[slot_positions][:, :, None]
        bank_rows = [self.bank_row[p] for p in prompts.tolist()]
        one_per_bank = bank_rows == list(range(len(self.bank_row)))  # block j writes bank row j
        index = torch.tensor(bank_rows)
        context_len = int(anchors.max())  # no block sees context at or past its anchor

        def key_plan(window, causal):
            if window is None or window - 1 >= context_len:
                context, rows = torch.arange(context_len).expand(anchors.numel(), -1), None
            else:  # a block at anchor a sees at most context a - window + 1 .. a - 1
                context = anchors[:, None] - (window - 1) + torch.arange(window - 1)[None]
                rows = block_len + context.clamp(min=0)
            return rows, block_key_mask(anchors, context, sizes, block_len, window, causal)

        plans = drafter.layer_masks(key_plan)
        x = drafter.embed(self.target, block)
        last = len(drafter.layers) - 1
        for i, (layer, (rows, mask), keys, values) in enumerate(zip(drafter.layers, plans, self.keys, self.values)):
            attn = layer.self_attn
            h = _rms(layer.input_layernorm, x)
            k = _rotate(_rms(attn.k_norm, attn.k_proj(h).view(*h.shape[:2], attn.kv_heads, attn.head_dim)), cos, sin)
            k, v = k.transpose(1, 2), attn.v_proj(h).view(*h.shape[:2], attn.kv_heads, attn.head_dim).transpose(1, 2)
            if i == last:  # every slot's K/V, but queries (and all after them) of slots 1.. only
                h, x, mask, q_cos, q_sin = h[:, 1:], x[:, 1:], mask[:, 1:], cos[:, 1:], sin[:, 1:]
            else:
                q_cos, q_sin = cos, sin
            q = _rotate(_rms(attn.q_norm, attn.q_proj(h).view(*h.shape[:2], attn.heads, attn.head_dim)), q_cos, q_sin)
            if rows is not None:  # the block, then the window before each anchor
                k = torch.cat([k, keys[index[:, None], :, rows].transpose(1, 2)], dim=2)
                v = torch.cat([v, values[index[:, None], :, rows].transpose(1, 2)], dim=2)
            elif one_per_bank:  # the block's K/V go into its bank: the context is not copied
                keys[:, :, :block_len], values[:, :, :block_len] = k, v
                k, v = keys[:, :, :block_len + context_len], values[:, :, :block_len + context_len]
            else:  # several blocks of one prompt (look-ahead)
                k = torch.cat([k, keys[index, :, block_len:block_len + context_len]], dim=2)
                v = torch.cat([v, values[index, :, block_len:block_len + context_len]], dim=2)
            out = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=mask[:, None],
                                                 scale=attn.head_dim**-0.5, enable_gqa=True)
            x = x + attn.o_proj(out.transpose(1, 2).reshape(*x.shape[:2], -1))
            x = x + layer.mlp(_rms(layer.post_attention_layernorm, x))
        return _rms(drafter.norm, x)


# -- the walks ---------------------------------------------------------------------------
def dflash_round(tokens: list[int], start: int, last: int, proposals: list[int]) -> int:
    """Tokens one greedy DFlash round from `start` produces, judged against the cached continuation.

    `proposals` may stop early, just after the first one the target rejects.
    """
    accepted = 0
    while accepted < min(len(proposals), last - start - 1) and proposals[accepted] == tokens[start + 1 + accepted]:
        accepted += 1
    return min(accepted + 1, last - start)


def ddtree_round(tokens: list[int], start: int, last: int, logits: torch.Tensor, budget: int) -> int:
    """Tokens one greedy DDTree round from `start` produces, judged against the cached continuation."""
    tree = build_tree(tokens[start], torch.log_softmax(logits.float(), dim=-1), budget)
    # On the accepted path the target's choice after depth d is the continuation's token.
    target_choice = [tokens[start + d + 1] if start + d + 1 <= last else -1 for d in tree.depths]
    return min(len(tree.walk(target_choice)), last - start)


def play_dflash(drafter: DFlashDrafter, head: nn.Module, rows: torch.Tensor, sizes: list[int],
                tokens: list[list[int]], starts: list[int], lasts: list[int]) -> list[int]:
    """DFlash rounds from slots 1.. of blocks, `rows` [n, B - 1, H]; the LM head reads later
    slots only while all earlier match."""
    early = DFLASH_EARLY_SLOTS
    proposals = drafter.compute_logits(rows[:, :early], head).argmax(-1).tolist()
    more = [i for i, (t, s, last) in enumerate(zip(tokens, starts, lasts))
            if sizes[i] - 1 > early and s + early < last and proposals[i] == t[s + 1:s + 1 + early]]
    if more:
        for i, rest in zip(more, drafter.compute_logits(rows[more, early:], head).argmax(-1).tolist()):
            proposals[i] += rest
    return [dflash_round(t, s, last, p[:size - 1]) for t, s, last, p, size in zip(tokens, starts, lasts, proposals, sizes)]


def play_ddtree(drafter: DFlashDrafter, head: nn.Module, rows: torch.Tensor, sizes: list[int],
                tokens: list[list[int]], starts: list[int], lasts: list[int], budget: int) -> list[int]:
    logits = drafter.compute_logits(rows, head)
    return [ddtree_round(t, s, last, block[:size - 1], budget)
            for t, s, last, block, size in zip(tokens, starts, lasts, logits, sizes)]


@torch.inference_mode()
def replay_walks(drafter: DFlashDrafter, target: nn.Module, entries: list[CachedPrompt], max_new_tokens: int,
                 play_rounds, batch_blocks: int = DEFAULT_BATCH_BLOCKS) -> list[list[int]]:
    """Per-round acceptance lengths of each prompt, walked in lockstep.

    Each step runs the drafter once for the current round of every unfinished prompt (the
    walk only ever needs the block at the anchors it reaches, about 1 in τ), then
    `play_rounds(rows, sizes, tokens, starts, lasts)` says how far each prompt advances.
    While fewer than `batch_blocks` prompts are left, the spare rows draft the blocks at
    the next anchors too, so one step can play several rounds of a prompt.
    """
    replay = BlockReplay(drafter, target, entries)
    tokens = [entry.token_ids.tolist() for entry in entries]
    lasts = [len(t) - 1 for t in tokens]  # rounds start at anchors prompt_len .. last - 1
    starts = [entry.prompt_len for entry in entries]
    # Near max_length the live loop shrinks the block to min(B, max_length - start).
    ends = [entry.prompt_len + max_new_tokens for entry in entries]
    rounds: list[list[int]] = [[] for _ in entries]
    while active := [p for p in range(len(entries)) if starts[p] < lasts[p]]:
        replay.keep(active)
        ahead = max(1, batch_blocks // len(active))
        blocks = [(p, a) for p in active for a in range(starts[p], min(starts[p] + ahead, lasts[p]))]
        sizes = [min(drafter.block_size, ends[p] - a) for p, a in blocks]
        hidden = replay.hidden(torch.tensor([p for p, _ in blocks]), torch.tensor([a for _, a in blocks]),
                               torch.tensor(sizes))
        drafted = {block: i for i, block in enumerate(blocks)}
        playing = active
        while playing:  # each prompt's first block, then look-ahead blocks its round ended on
            index = [drafted[p, starts[p]] for p in playing]
            produced = play_rounds(hidden[index], [sizes[i] for i in index], [tokens[p] for p in playing],
                                   [starts[p] for p in playing], [lasts[p] for p in playing])
            for p, length in zip(playing, produced):
                rounds[p].append(length)
                starts[p] += length
            playing = [p for p in playing if (p, starts[p]) in drafted]
    return rounds


def offline_rounds_batch(drafter: DFlashDrafter, target: nn.Module, cache: HiddenStateCache,
                         entries: list[CachedPrompt], method: str = "dflash", budget: int | None = None,
                         group: int = DEFAULT_PROMPT_GROUP) -> list[list[int]]:
    """Per-round acceptance lengths of greedy DFlash or DDTree on each cached prompt."""
    if method == "dflash":
        play_rounds = functools.partial(play_dflash, drafter, output_head(target))
    elif method == "ddtree":
        if budget is None:
            raise ValueError("ddtree needs a node budget")
        play_rounds = functools.partial(play_ddtree, drafter, output_head(target), budget=budget)
    else:
        raise ValueError(f"unknown method {method!r}; expected dflash or ddtree")
    return [rounds for i in range(0, len(entries), group)
            for rounds in replay_walks(drafter, target, entries[i:i + group], cache.max_new_tokens, play_rounds)]


def offline_rounds_each(drafter: DFlashDrafter, target: nn.Module, cache: HiddenStateCache,
                        entries: list[CachedPrompt], method: str = "dflash", budget: int | None = None,
                        chunk: int = 16):
    """(entry, rounds) for each prompt, replayed `chunk` prompts at a time: batched, yet a
    progress bar can follow."""
    for i in range(0, len(entries), chunk):
        part = entries[i:i + chunk]
        yield from zip(part, offline_rounds_batch(drafter, target, cache, part, method, budget))


def offline_rounds(drafter: DFlashDrafter, target: nn.Module, cache: HiddenStateCache, entry: CachedPrompt,
                   method: str = "dflash", budget: int | None = None) -> list[int]:
    return offline_rounds_batch(drafter, target, cache, [entry], method, budget)[0]


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

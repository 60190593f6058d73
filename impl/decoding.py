"""Live DFlash: speculative decoding with a Hugging Face target and our `DFlashDrafter`.

One round, starting from `start` = position of the last known token (the previous bonus,
not yet in the target's KV cache):
1. the drafter sees the target's context features of the tokens accepted since its last
   call (its own `DraftCache` holds the older ones) and denoises the block
   `[last token, mask x (B-1)]`, which proposes B-1 tokens from slots 1.. (or, under the
   sample-from-anchor slot layout, B tokens from every slot: impl/slot_layout.py);
2. the target verifies `[last token, proposals]` in one KV-cached forward;
3. the longest prefix of proposals the target agrees with is accepted, plus one bonus
   token from the target; both caches are cut back to the accepted length.
The acceptance length of a round is accepted proposals + 1 (the bonus), capped by
`max_new_tokens` and by the first stop token — the same bookkeeping as z-lab's
`dflash_generate`, so per-round lengths compare one to one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn
from transformers import DynamicCache

from foundation.transformers_compat import cache_argument, crop_to
from foundation.placement import target_device
from impl.anchors import anchor_blocks
from impl.dspark import draft_left_to_right
from impl.extract import context_features, output_head
from impl.model import DFlashDrafter, DraftCache
from impl.slot_layout import draft_block_size
from impl.xpress import jacobi_resolve
from impl.acceptance import acceptance_histogram, mean_acceptance  # noqa: F401 (re-exported)


@dataclass
class DecodeResult:
    output_ids: torch.Tensor  # [1, prompt + generated]
    num_prompt_tokens: int
    acceptance_lengths: list[int]  # per round, bonus included
    extra: dict = field(default_factory=dict)

    @property
    def new_tokens(self) -> list[int]:
        return self.output_ids[0, self.num_prompt_tokens:].tolist()

    @property
    def tau(self) -> float:
        return mean_acceptance(self.acceptance_lengths)


class StopTokens:
    def __init__(self, stop_token_ids: list[int] | None):
        self.ids = set(stop_token_ids or [])

    def cut(self, tokens: list[int]) -> tuple[list[int], bool]:
        """`tokens` up to and including the first stop token, and whether one was met."""
        for i, token in enumerate(tokens):
            if token in self.ids:
                return tokens[: i + 1], True
        return tokens, False


def make_target_cache(target: nn.Module) -> DynamicCache:
    cache = DynamicCache(config=target.config)
    # Sliding-window targets must keep past states to be cropped back after a rejection.
    cache.activate_past_recording()
    return cache


class Sampler:
    """Greedy (temperature 0) or seeded sampling at a temperature."""

    def __init__(self, temperature: float = 0.0, seed: int = 0):
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        self.temperature = temperature
        self.generator = torch.Generator().manual_seed(seed) if temperature > 0 else None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        return torch.softmax(logits.float() / self.temperature, dim=-1)

    def draw(self, probs: torch.Tensor) -> torch.Tensor:
        """One token per row of `probs` [..., V]. Drawn from the one CPU generator, so a seed gives
        the same draws whichever device the models sit on."""
        flat = probs.reshape(-1, probs.shape[-1]).to(self.generator.device)
        return torch.multinomial(flat, 1, generator=self.generator).view(probs.shape[:-1]).to(probs.device)

    def pick(self, logits: torch.Tensor) -> torch.Tensor:
        return logits.argmax(-1) if self.greedy else self.draw(self.probs(logits))

    def uniform(self, n: int, device: torch.device) -> torch.Tensor:
        return torch.rand(n, generator=self.generator, device=self.generator.device).to(device)

    def pick_index(self, scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(index [b], probs [b, k] or None) of one choice among `scores` [b, k]: the DFlash2 selector's step."""
        if self.greedy:
            return scores.argmax(-1), None
        probs = self.probs(scores)
        return self.draw(probs), probs


def verify_greedy(proposals: torch.Tensor, target_logits: torch.Tensor) -> tuple[int, int]:
    """(accepted proposals, bonus token): proposals [k], target logits [k + 1, V]."""
    posterior = target_logits.argmax(-1)
    matches = (proposals == posterior[:-1]).long()
    accepted = int(matches.cumprod(0).sum())
    return accepted, int(posterior[accepted])


def verify_sampled(sampler: Sampler, proposals: torch.Tensor, draft_probs: torch.Tensor,
                   target_logits: torch.Tensor) -> tuple[int, int]:
    """Speculative rejection sampling (Leviathan et al.): the output follows the target's distribution.

    Proposal i is kept with probability min(1, p_i(x) / q_i(x)); at the first rejection the
    replacement is drawn from the residual max(0, p - q) (normalised); if all are kept the
    bonus is drawn from the target's next distribution.
    """
    target_probs = sampler.probs(target_logits)
    k = proposals.numel()
    p = target_probs[:k].gather(-1, proposals[:, None])[:, 0]
    q = draft_probs.gather(-1, proposals[:, None])[:, 0]
    kept = (sampler.uniform(k, q.device) * q < p).long()
    accepted = int(kept.cumprod(0).sum())
    if accepted == k:
        return accepted, int(sampler.draw(target_probs[k]))
    residual = (target_probs[accepted] - draft_probs[accepted]).clamp_min(0)
    total = residual.sum()
    # p == q everywhere leaves no residual mass; the target's own distribution is then exact.
    residual = residual / total if total > 0 else target_probs[accepted]
    return accepted, int(sampler.draw(residual))


class TargetSession:
    """The target behind a KV cache: prefill, then verify blocks and roll back rejections."""

    def __init__(self, target: nn.Module, layer_ids: list[int]):
        self.target = target
        self.layer_ids = layer_ids
        self.cache = make_target_cache(target)
        self.device = target_device(target)  # a sharded target's logits come back here, beside the drafter

    def forward(self, token_ids: torch.Tensor, start: int, logits_to_keep: int = 0,
                positions: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None):
        """Logits [q, V] and context features [1, q, F] of `token_ids` placed after the cache."""
        if positions is None:
            positions = torch.arange(start, start + token_ids.shape[1], device=token_ids.device)
        out = self.target(token_ids, position_ids=positions[None], **cache_argument(self.target, self.cache),
                          use_cache=True, attention_mask=attention_mask, output_hidden_states=True,
                          logits_to_keep=logits_to_keep)
        return out.logits[0].to(self.device), context_features(out.hidden_states, self.layer_ids)

    def keep(self, length: int) -> None:
        crop_to(self.cache, length)

    def keep_positions(self, prefix: int, rows: torch.Tensor) -> None:
        """Keep the first `prefix` cache entries plus entries `prefix + rows` (a tree's accepted path)."""
        index = torch.cat([torch.arange(prefix, device=rows.device), prefix + rows])
        for layer in self.cache.layers:
            if type(layer).__name__ != "DynamicLayer":
                raise ValueError(f"tree verification needs full-attention cache layers, got {type(layer).__name__}")
            at = index.to(layer.keys.device)  # each shard's cache on its own device
            layer.keys = layer.keys.index_select(-2, at)
            layer.values = layer.values.index_select(-2, at)


def round_size(drafter: DFlashDrafter, start: int, max_length: int) -> tuple[int, int]:
    """(proposals, drafted block size) of a round from `start`: the layout's speculative tokens, no more than
    are left to generate, the block shrunk to match near `max_length` (z-lab's `min(B, max_length - start)`)."""
    proposals = min(drafter.spec.speculative_tokens, max_length - start - 1)
    if drafter.reads_whole_block:  # DSpark's chain and XPress's refiner read the block whole: never shrunk
        return proposals, drafter.block_size
    return proposals, draft_block_size(proposals, drafter.spec.sample_from_anchor)


def draft_block(drafter: DFlashDrafter, target: nn.Module, draft_cache: DraftCache,
                new_features: torch.Tensor, last_token: int, start: int, size: int):
    """One drafter pass over `[last token, mask x (size-1)]` at positions start..start+size-1.

    Returns the block [1, size] (proposals still masked) and the hidden states of its proposing slots
    [1, n, H]: slots 1.. (anchor as the bonus), or every slot (sample-from-anchor), slot k's proposal
    being the token at start + k, resp. start + k + 1 (impl/slot_layout.py).
    """
    device = new_features.device
    block = anchor_blocks(torch.tensor([last_token], device=device), size, drafter.mask_token_id)
    # The drafter's new keys are the context features it has not seen yet, then the block.
    positions = torch.arange(start - new_features.shape[1], start + size, device=device)[None]
    hidden = drafter(drafter.embed(target, block), new_features, positions, cache=draft_cache)
    draft_cache.crop(start)  # keep context only: the block is redrawn next round (our own cache: keeps `start`)
    return block, hidden if drafter.reads_whole_block else hidden[:, drafter.spec.first_proposing_slot:]


def verify_block(last_token: int, proposals: torch.Tensor) -> torch.Tensor:
    """[1, n + 1]: what the target verifies, the last known token then the proposals (either layout)."""
    return torch.cat([torch.tensor([last_token], dtype=proposals.dtype, device=proposals.device), proposals])[None]


def propose(drafter: DFlashDrafter, head: nn.Module, hidden: torch.Tensor, last_token: int,
            sampler: Sampler, before_last: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(proposals [n], draft distribution [n, V] or None when greedy) from the proposing slots of a block [1, n, H]
    (every slot, for a drafter that reads the whole block).

    DFlash takes each slot's own choice; DFlash2 walks its selector through the unary top-k,
    each choice the next slot's predecessor (z-lab's `DFlash2DraftModel.propose`); DSpark walks its Markov
    chain and XPress resolves the block by Jacobi passes (`whole_block_proposals`).
    """
    if drafter.reads_whole_block:
        anchor = torch.tensor([last_token], device=hidden.device)
        before = torch.tensor([last_token if before_last is None else before_last], device=hidden.device)
        tokens, probs = whole_block_proposals(drafter, head, hidden, anchor, before, sampler.pick_index)
        return tokens[0], probs[0] if probs is not None else None
    logits = drafter.compute_logits(hidden[0], head)
    if drafter.candidate_selector is None:
        if sampler.greedy:
            return logits.argmax(-1), None
        probs = sampler.probs(logits)
        return sampler.draw(probs), probs
    first = torch.tensor([last_token], device=hidden.device)
    path = drafter.candidate_selector.select(hidden, logits[None], first, sampler.pick_index)
    if path.probs is None:
        return path.tokens[0], None
    # The selector's distribution lives on the candidates; everything else has probability 0.
    dense = torch.zeros_like(logits, dtype=path.probs.dtype).scatter(-1, path.candidates[0], path.probs[0])
    return path.tokens[0], dense


def whole_block_proposals(drafter: DFlashDrafter, head: nn.Module, hidden: torch.Tensor, anchors: torch.Tensor,
                          before_anchors: torch.Tensor, pick):
    """(tokens [b, n], probs [b, n, V] or None) of whole blocks [b, S, H]: DSpark's Markov chain left to right, or
    XPress's Jacobi passes (greedy only; `pick` must then be an argmax)."""
    base = drafter.compute_logits(hidden, head)
    first = drafter.spec.first_proposing_slot
    if drafter.markov_head is not None:
        return draft_left_to_right(drafter.markov_head, hidden, base, anchors, first, pick)
    tokens = jacobi_resolve(drafter.refiner_head, hidden, base, anchors, before_anchors, drafter.spec.num_jacobi_passes,
                            drafter.spec.sample_from_anchor)
    return tokens, None


def check_sampling(drafter: DFlashDrafter, temperature: float) -> None:
    """XPress resolves a block by argmax passes only (speculators' rounds, vLLM's `jacobi_refine_greedy`)."""
    if drafter.refiner_head is not None and temperature > 0:
        raise ValueError(f"temperature {temperature}: an XPress drafter resolves its blocks greedily (argmax Jacobi "
                         "passes, as vLLM's XPressSpeculator); sampling from it is not defined")


@dataclass
class DecodeStart:
    """What both decoding loops (this one and `ddtree.ddtree_decode`) begin with: the target run over the prompt
    (its first token picked), its session and the drafter's cache, and the output's bound."""

    input_ids: torch.Tensor  # the prompt, where the target reads its inputs
    max_length: int  # prompt + max_new_tokens
    head: nn.Module
    session: TargetSession
    draft_cache: DraftCache
    new_features: torch.Tensor  # the target's features the drafter has not seen yet
    tokens: list[int]  # prompt + the target's first token
    stopped: bool

    @property
    def prompt_len(self) -> int:
        return self.input_ids.shape[1]


def start_decoding(drafter: DFlashDrafter, target: nn.Module, input_ids: torch.Tensor, max_new_tokens: int,
                   stops: StopTokens, pick) -> DecodeStart:
    """The target over the prompt; `pick(logits)` chooses its first token (argmax, or the sampler's)."""
    input_ids = input_ids.to(target_device(target))
    session = TargetSession(target, drafter.target_layer_ids)
    logits, new_features = session.forward(input_ids, 0, logits_to_keep=1)
    tokens = input_ids[0].tolist() + [int(pick(logits[-1]))]
    return DecodeStart(input_ids, input_ids.shape[1] + max_new_tokens, output_head(target), session,
                       DraftCache(drafter.spec.num_hidden_layers), new_features, tokens,
                       tokens[input_ids.shape[1]] in stops.ids)


@torch.inference_mode()
def dflash_decode(drafter: DFlashDrafter, target: nn.Module, input_ids: torch.Tensor, max_new_tokens: int,
                  stop_token_ids: list[int] | None = None, temperature: float = 0.0, seed: int = 0,
                  keep_features: bool = False, whole_blocks: bool = False) -> DecodeResult:
    """Speculative decoding of one prompt (`input_ids` [1, T]); greedy unless `temperature` > 0. With
    `keep_features`, `extra["features"]` holds the target's context features of every accepted position
    [1, T - 1, F], as the verification forwards gave them to the drafter (`walks.explain_parting` reads them).
    With `whole_blocks`, every round drafts the whole block, its proposals cut to what is left (llama.cpp's way),
    not z-lab's block shrunk near max_length: a non-causal block's slots see every mask, so the two can part."""
    check_sampling(drafter, temperature)
    sampler, stops = Sampler(temperature, seed), StopTokens(stop_token_ids)
    begun = start_decoding(drafter, target, input_ids, max_new_tokens, stops, sampler.pick)
    input_ids, prompt_len, max_length, head = begun.input_ids, begun.prompt_len, begun.max_length, begun.head
    session, draft_cache, new_features, tokens = begun.session, begun.draft_cache, begun.new_features, begun.tokens
    start = prompt_len  # position of the last known token, which the target has not seen yet
    stopped = begun.stopped
    rounds: list[int] = []
    drafted: list[list[int]] = []  # each round's proposals: the live serving check matches them block by block
    fed = [new_features]
    while not stopped and start + 1 < max_length:
        _, size = round_size(drafter, start, max_length)
        size = drafter.block_size if whole_blocks else size
        _, draft_hidden = draft_block(drafter, target, draft_cache, new_features, tokens[start], start, size)
        proposals, draft_probs = propose(drafter, head, draft_hidden, tokens[start], sampler, tokens[start - 1])
        drafted.append(proposals.tolist())

        target_logits, block_features = session.forward(verify_block(tokens[start], proposals), start)
        if sampler.greedy:
            accepted, bonus = verify_greedy(proposals, target_logits)
        else:
            accepted, bonus = verify_sampled(sampler, proposals, draft_probs, target_logits)
        produced = proposals[:accepted].tolist() + [bonus]
        produced, stopped = stops.cut(produced[: max_length - start - 1])
        tokens.extend(produced)
        rounds.append(len(produced))
        # Accepted = the block's first token plus all produced but the last (the new bonus).
        new_features = block_features[:, : len(produced)]
        fed += [new_features] if keep_features else []
        start += len(produced)
        session.keep(start)

    output_ids = torch.tensor([tokens[:max_length]], device=input_ids.device)
    return DecodeResult(output_ids=output_ids, num_prompt_tokens=prompt_len, acceptance_lengths=rounds,
                        extra={"proposals": drafted, **({"features": torch.cat(fed, 1)} if keep_features else {})})

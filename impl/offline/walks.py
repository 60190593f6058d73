"""The DFlash and DDTree acceptance walks, replayed from the cache, and where they part from a live run."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import nn

from foundation.placement import dtype_name
from impl.ddtree import DraftTree, build_tree, require_dflash_family
from impl.decoding import round_size, whole_block_proposals
from impl.extract import output_head
from impl.model import DFlashDrafter
from impl.near_tie import near_tie, ulps_apart
from impl.offline.cache import CachedPrompt, HiddenStateCache
from impl.offline.replay import BlockReplay

DEFAULT_PROMPT_GROUP = 64  # prompts walked in lockstep; bounds the padded context K/V
DEFAULT_BATCH_BLOCKS = 8  # blocks per drafter pass while few prompts are left
# Look-ahead blocks x context positions one pass may attend to: a full layer's block attends to the whole context, so
# past a few thousand positions the look-ahead blocks a round does not reach cost more than the passes they save.
LOOKAHEAD_CONTEXT = 4096
DFLASH_EARLY_SLOTS = 2  # slots the LM head always reads; later ones only while all earlier match


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


def play_dflash(drafter: DFlashDrafter, head: nn.Module, rows: torch.Tensor, counts: list[int],
                tokens: list[list[int]], starts: list[int], lasts: list[int]) -> list[int]:
    """DFlash rounds from the proposing slots of blocks, `rows` [n, speculative tokens, H], block i
    proposing `counts[i]` tokens; the LM head reads later slots only while all earlier match."""
    if drafter.candidate_selector is not None:
        return play_dflash2(drafter, head, rows, counts, tokens, starts, lasts)
    if drafter.reads_whole_block:
        return play_whole_blocks(drafter, head, rows, counts, tokens, starts, lasts)
    early = DFLASH_EARLY_SLOTS
    proposals = drafter.compute_logits(rows[:, :early], head).argmax(-1).tolist()
    more = [i for i, (t, s, last) in enumerate(zip(tokens, starts, lasts))
            if counts[i] > early and s + early < last and proposals[i] == t[s + 1:s + 1 + early]]
    if more:
        for i, rest in zip(more, drafter.compute_logits(rows[more, early:], head).argmax(-1).tolist()):
            proposals[i] += rest
    return [dflash_round(t, s, last, p[:n]) for t, s, last, p, n in zip(tokens, starts, lasts, proposals, counts)]


def play_dflash2(drafter: DFlashDrafter, head: nn.Module, rows: torch.Tensor, counts: list[int],
                 tokens: list[list[int]], starts: list[int], lasts: list[int]) -> list[int]:
    """DFlash2 rounds: the selector's greedy path through every slot's unary top-k, from each block's known token."""
    first = torch.tensor([t[s] for t, s in zip(tokens, starts)], device=rows.device)
    path = drafter.candidate_selector.select(rows, drafter.compute_logits(rows, head), first,
                                             lambda scores: (scores.argmax(-1), None))
    return [dflash_round(t, s, last, p[:n])
            for t, s, last, p, n in zip(tokens, starts, lasts, path.tokens.tolist(), counts)]


def play_whole_blocks(drafter: DFlashDrafter, head: nn.Module, rows: torch.Tensor, counts: list[int],
                      tokens: list[list[int]], starts: list[int], lasts: list[int]) -> list[int]:
    """DSpark and XPress rounds: every slot of each block [n, B, H], greedily, from its known token (and the one
    before it, XPress's first previous token)."""
    device = rows.device
    anchors = torch.tensor([t[s] for t, s in zip(tokens, starts)], device=device)
    before = torch.tensor([t[s - 1] for t, s in zip(tokens, starts)], device=device)
    proposals, _ = whole_block_proposals(drafter, head, rows, anchors, before, lambda logits: (logits.argmax(-1), None))
    return [dflash_round(t, s, last, p[:n]) for t, s, last, p, n in zip(tokens, starts, lasts, proposals.tolist(), counts)]


def play_ddtree(drafter: DFlashDrafter, head: nn.Module, rows: torch.Tensor, counts: list[int],
                tokens: list[list[int]], starts: list[int], lasts: list[int], budget: int) -> list[int]:
    logits = drafter.compute_logits(rows, head)
    return [ddtree_round(t, s, last, block[:n], budget)
            for t, s, last, block, n in zip(tokens, starts, lasts, logits, counts)]


@torch.inference_mode()
def replay_walks(drafter: DFlashDrafter, target: nn.Module, entries: list[CachedPrompt], max_new_tokens: int,
                 play_rounds, batch_blocks: int = DEFAULT_BATCH_BLOCKS, block_positions=None) -> list[list[int]]:
    """Per-round acceptance lengths of each prompt, walked in lockstep.

    Each step runs the drafter once for the current round of every unfinished prompt (the
    walk only ever needs the block at the anchors it reaches, about 1 in τ), then
    `play_rounds(rows, counts, tokens, starts, lasts)` says how far each prompt advances (`counts`: the
    tokens each block proposes).
    While fewer than `batch_blocks` prompts are left, the spare rows draft the blocks at
    the next anchors too, so one step can play several rounds of a prompt (fewer on a long context
    for a drafter with a full layer: LOOKAHEAD_CONTEXT).
    """
    replay = BlockReplay(drafter, target, entries, block_positions)
    tokens = [entry.token_ids.tolist() for entry in entries]
    lasts = [len(t) - 1 for t in tokens]  # rounds start at anchors prompt_len .. last - 1
    starts = [entry.prompt_len for entry in entries]
    # Near max_length the live loop shrinks the block (`round_size`): the same here.
    ends = [entry.prompt_len + max_new_tokens for entry in entries]
    rounds: list[list[int]] = [[] for _ in entries]
    full_layer = any(drafter.spec.window_of(i) is None for i in range(drafter.spec.num_hidden_layers))
    while active := [p for p in range(len(entries)) if starts[p] < lasts[p]]:
        replay.keep(active)
        ahead = max(1, batch_blocks // len(active))
        if full_layer:  # its blocks attend to the whole context: few look-ahead blocks on a long one
            ahead = max(1, min(ahead, LOOKAHEAD_CONTEXT // max(len(tokens[p]) for p in active)))
        blocks = [(p, a) for p in active for a in range(starts[p], min(starts[p] + ahead, lasts[p]))]
        counts, sizes = zip(*(round_size(drafter, a, ends[p]) for p, a in blocks))
        device = replay.device
        hidden = replay.hidden(torch.tensor([p for p, _ in blocks], device=device),
                               torch.tensor([a for _, a in blocks], device=device), torch.tensor(sizes, device=device))
        drafted = {block: i for i, block in enumerate(blocks)}
        playing = active
        while playing:  # each prompt's first block, then look-ahead blocks its round ended on
            index = [drafted[p, starts[p]] for p in playing]
            produced = play_rounds(hidden[index], [counts[i] for i in index], [tokens[p] for p in playing],
                                   [starts[p] for p in playing], [lasts[p] for p in playing])
            for p, length in zip(playing, produced):
                rounds[p].append(length)
                starts[p] += length
            playing = [p for p in playing if (p, starts[p]) in drafted]
    return rounds


def offline_rounds_batch(drafter: DFlashDrafter, target: nn.Module, cache: HiddenStateCache,
                         entries: list[CachedPrompt], method: str = "dflash", budget: int | None = None,
                         group: int = DEFAULT_PROMPT_GROUP, block_positions=None) -> list[list[int]]:
    """Per-round acceptance lengths of greedy DFlash or DDTree on each cached prompt (`block_positions`: see
    `BlockReplay`)."""
    if method == "dflash":
        play_rounds = functools.partial(play_dflash, drafter, output_head(target))
    elif method == "ddtree":
        require_dflash_family(drafter)
        if budget is None:
            raise ValueError("ddtree needs a node budget")
        play_rounds = functools.partial(play_ddtree, drafter, output_head(target), budget=budget)
    else:
        raise ValueError(f"unknown method {method!r}; expected dflash or ddtree")
    return [rounds for i in range(0, len(entries), group)
            for rounds in replay_walks(drafter, target, entries[i:i + group], cache.max_new_tokens, play_rounds,
                                       block_positions=block_positions)]


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


# -- why a walk parts from a live one --------------------------------------------------------
@dataclass
class Parting:
    """A replay that parts from a live run, set against the features the live loop's drafter read.

    The cache's forward (one position at a time, in a padded batch) and the live loop's verification forwards
    (a block or a tree at a time) give the same target states rounded apart: a few ulps of float32, about one
    of bfloat16. A drafter decision whose margin is within what that moves its scores goes either way."""

    mismatch: Mismatch
    feature_ulps: float  # the features' largest difference, live vs cache, in ulps of their dtype at each layer's scale
    replayed: bool  # the replay fed the live loop's own features walks every round as the live loop did
    margin: float | None  # the parting round's deciding gap of the drafter's scores, from the cache's features
    moved: float | None  # twice the most the features' difference moves the scores of that decision

    def near_tie(self, dtype: torch.dtype) -> bool:
        """The one near-tie rule (`impl/near_tie.py`) for two computations by the same kernels: fed the live loop's
        own features the replay walks as it did, and the deciding gap is within what their rounding moves."""
        return self.replayed and near_tie(self.margin, dtype, self.moved, self.feature_ulps, same_kernels=True)

    def describe(self) -> str:
        decided = ("no drafter decision found that parts" if self.margin is None else
                   f"the drafter's deciding gap {self.margin:.3g}, its scores moved {self.moved:.3g}")
        replay = "walks as the live loop" if self.replayed else "still parts"
        return (f"{self.mismatch.describe()}: the live loop's features are {self.feature_ulps:.3g} ulps from the "
                f"cache's; {decided}; the replay from the live loop's features {replay}")


def unexplained_partings(partings: list[Parting], dtype: torch.dtype) -> list[str]:
    """The partings of a replay from a live run that the rounding of the target's states does not account for, the
    one rule the tests and the benches judge by. float32: every one (the walks agree). Below it, each parting must be
    a drafter near-tie: fed the live loop's own features the replay walks every round as the live loop did, those
    features are within the dtype's rounding (ROUNDING_ULPS) of the cache's, and the deciding gap of the parting
    round is within what that difference moves the drafter's scores (`impl/near_tie.py`, the one rule)."""
    if dtype == torch.float32:  # the same kernels: no parting is a tie
        return [p.mismatch.describe() for p in partings]
    return [p.describe() for p in partings if not p.near_tie(dtype)]


def replay_exactness(dtype: torch.dtype) -> str | None:
    """What a report says of offline τ measured in `dtype` (None in float32, where the two roundings are a few ulps
    of float32 apart and the walks agree on every test)."""
    if dtype == torch.float32:
        return None
    return (f"offline τ is the live loop's, round for round, up to drafter near-ties: the cache's forward and the "
            f"live loop's verification forwards round the target's states apart (by about an ulp of "
            f"{dtype_name(dtype)}), which can decide a drafter choice whose margin is within that")


@torch.inference_mode()
def explain_parting(drafter: DFlashDrafter, target: nn.Module, cache: HiddenStateCache, entry: CachedPrompt,
                    method: str, offline: list[int], live: list[int], live_features: torch.Tensor,
                    live_output_ids: torch.Tensor | None = None, budget: int | None = None) -> Parting | None:
    """Where and why the replay `offline` parts from the live rounds `live`, given the context features the live
    loop's drafter read (`live_features` [1, n, F], its `keep_features`): None when they agree."""
    mismatch = find_mismatch(entry, offline, live, live_output_ids)
    if mismatch is None:
        return None
    ids, n = list(drafter.target_layer_ids), live_features.shape[1]
    width = live_features.shape[-1] // len(ids)
    layers = dict(entry.layers)
    ulps = 0.0
    for j, layer_id in enumerate(ids):
        fed = live_features[0, :, j * width:(j + 1) * width].to(entry.layers[layer_id].device)
        cached = entry.layers[layer_id][:n]
        ulps = max(ulps, ulps_apart(fed, cached))
        layers[layer_id] = torch.cat([fed.to(cached.dtype), entry.layers[layer_id][n:]])
    as_live = CachedPrompt(entry.id, entry.token_ids, entry.prompt_len, layers, entry.margin)
    replayed = offline_rounds(drafter, target, cache, as_live, method, budget) == list(live)
    anchor = entry.prompt_len + sum(offline[:mismatch.round])
    margin = moved = None
    if mismatch.round < len(offline) and anchor < len(entry.token_ids) - 1:
        scored = [_round_scores(drafter, target, e, anchor, entry.prompt_len + cache.max_new_tokens, method, budget)
                  for e in (entry, as_live)]
        if all(s is not None for s in scored):
            margin, moved = _deciding_gap(*scored, method, budget)
    return Parting(mismatch, ulps, replayed, margin, moved)


def _round_scores(drafter: DFlashDrafter, target: nn.Module, entry: CachedPrompt, anchor: int, max_length: int,
                  method: str, budget: int | None):
    """The scores the round at `anchor` decides by: DDTree the per-depth log-probabilities [D, V], DFlash each
    greedy choice's scores in order (every slot's logits; DFlash2's selector and DSpark's chain, step by step);
    None for a drafter whose choices are no single argmax (XPress's Jacobi passes)."""
    head = output_head(target)
    count, size = round_size(drafter, anchor, max_length)
    replay = BlockReplay(drafter, target, [entry])
    device = replay.device
    one = torch.tensor([0], device=device)
    rows = replay.hidden(one, torch.tensor([anchor], device=device), torch.tensor([size], device=device))
    if method == "ddtree":
        return torch.log_softmax(drafter.compute_logits(rows, head)[0, :count].float(), dim=-1)
    decisions = []

    def pick(scores):
        decisions.append(scores[0].float())
        return scores.argmax(-1), None

    known = torch.tensor([int(entry.token_ids[anchor])], device=device)
    if drafter.candidate_selector is not None:
        drafter.candidate_selector.select(rows, drafter.compute_logits(rows, head), known, pick)
    elif drafter.reads_whole_block:
        if drafter.markov_head is None:
            return None
        before = torch.tensor([int(entry.token_ids[anchor - 1])], device=device)
        whole_block_proposals(drafter, head, rows, known, before, pick)
    else:
        decisions = list(drafter.compute_logits(rows, head)[0].float())
    return decisions[:count]


def _deciding_gap(cached, live, method: str, budget: int | None) -> tuple[float | None, float | None]:
    """(the gap of the first decision the two score sets take differently, from the cache's scores; twice the most
    the scores of that decision moved), or (None, None) when they take every decision alike."""
    if method == "ddtree":  # the tree keeps the `budget` best paths: the decision is the gap at that border
        trees = [build_tree(0, scores, budget + 1) for scores in (cached, live)]
        kept = [{_path(tree, node) for node in range(1, min(len(tree), budget + 1))} for tree in trees]
        if kept[0] == kept[1] or len(trees[0]) < budget + 2:  # no path left out
            return None, None
        scores = [_path_score(cached, _path(trees[0], node)) for node in (budget, budget + 1)]
        paths = {_path(tree, node) for tree in trees for node in range(1, len(tree))}
        return scores[0] - scores[1], 2 * max(abs(_path_score(cached, p) - _path_score(live, p)) for p in paths)
    for a, b in zip(cached, live):
        if int(a.argmax()) != int(b.argmax()):
            top2 = a.topk(2).values
            return float(top2[0] - top2[1]), 2 * float((a - b).abs().max())
    return None, None


def _path(tree: DraftTree, node: int) -> tuple[int, ...]:
    tokens = []
    while node > 0:
        tokens.append(tree.tokens[node])
        node = tree.parents[node]
    return tuple(reversed(tokens))


def _path_score(logprobs: torch.Tensor, path: tuple[int, ...]) -> float:
    return float(sum(logprobs[depth, token] for depth, token in enumerate(path)))

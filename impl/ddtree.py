"""Live DDTree: DFlash's one drafter pass turned into a token tree verified in one target forward.

The drafter's block pass gives one distribution per depth (the d-th proposing slot predicts
the token d steps after the last known one, under either slot layout). Those depths are treated as independent, so the score of
a path is the sum of its tokens' log-probabilities, and the `budget` best paths (nodes) are
found best-first with a heap: popping a node pushes its best child and its next sibling.
The target scores every node at once: each node attends to the KV cache and to its own
ancestors only, at position `start + depth`. The walk follows the target's greedy token
while it matches a child; the KV cache is compacted to the accepted path. Greedy only,
and lossless: the output equals plain greedy decoding.

DDTree is defined on DFlash drafters only. A DFlash2 drafter's proposals come from its
selector, which scores a slot's candidates given the token chosen before it: its depths
are not independent marginals, and neither reference defines how a tree would use them.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import torch
from torch import nn

from foundation.errors import AuditError
from impl.decoding import DecodeResult, StopTokens, draft_block, round_size, start_decoding
from impl.model import DFlashDrafter

DDTREE_NEEDS_DFLASH = ("DDTree is defined on DFlash drafters only: a DFlash2 drafter's selector scores each "
                       "slot given the token before it (as DSpark's Markov head and XPress's refiner do), so its "
                       "slots are not the independent marginals a tree is built from")


def require_dflash_family(drafter: DFlashDrafter) -> None:
    if drafter.spec.family != "dflash":
        raise AuditError(DDTREE_NEEDS_DFLASH)


@dataclass
class DraftTree:
    """Node 0 is the root (the last known token); every other node is one drafted token."""

    tokens: list[int]
    parents: list[int]  # -1 for the root
    depths: list[int]
    children: list[dict[int, int]]  # token -> node

    def __len__(self) -> int:
        return len(self.tokens)

    def add(self, parent: int, token: int) -> int:
        node = len(self.tokens)
        self.tokens.append(token)
        self.parents.append(parent)
        self.depths.append(self.depths[parent] + 1)
        self.children.append({})
        self.children[parent][token] = node
        return node

    def ancestor_mask(self, device: torch.device) -> torch.Tensor:
        """[n, n] bool: node i may attend to node j when j is i or one of its ancestors."""
        n = len(self)
        mask = torch.zeros(n, n, dtype=torch.bool, device=device)
        for node in range(n):  # parents precede children, so the parent's row is complete
            if self.parents[node] >= 0:
                mask[node] = mask[self.parents[node]]
            mask[node, node] = True
        return mask

    def walk(self, next_tokens: list[int]) -> list[int]:
        """Nodes of the accepted path from the root, following `next_tokens[node]` (the target's choice)."""
        path = [0]
        while next_tokens[path[-1]] in self.children[path[-1]]:
            path.append(self.children[path[-1]][next_tokens[path[-1]]])
        return path


def build_tree(root_token: int, depth_logprobs: torch.Tensor, budget: int) -> DraftTree:
    """The `budget` highest-scoring nodes (paths) under independent per-depth log-probabilities [D, V]."""
    tree = DraftTree(tokens=[root_token], parents=[-1], depths=[0], children=[{}])
    depth_count = depth_logprobs.shape[0]
    if budget <= 0 or depth_count == 0:
        return tree
    # Only proposable tokens: a reduced draft vocabulary leaves the others at -inf (impl.model.compute_logits).
    k = min(budget, int((depth_logprobs[0] != float("-inf")).sum()))  # NaN (an overflow) still counts
    if k == 0:
        return tree
    top_scores, top_tokens = (t.tolist() for t in depth_logprobs.float().topk(k, dim=-1))
    # Heap entry: (-path score, tiebreak, parent node, depth index, rank within that depth's top-k).
    heap = [(-top_scores[0][0], 0, 0, 0, 0)]
    pushes = 1
    while heap and len(tree) - 1 < budget:
        neg_score, _, parent, depth, rank = heapq.heappop(heap)
        node = tree.add(parent, top_tokens[depth][rank])
        parent_score = -neg_score - top_scores[depth][rank]
        if rank + 1 < k:  # next sibling: same parent, next-best token at this depth
            heapq.heappush(heap, (-(parent_score + top_scores[depth][rank + 1]), pushes, parent, depth, rank + 1))
            pushes += 1
        if depth + 1 < depth_count:  # best child
            heapq.heappush(heap, (neg_score - top_scores[depth + 1][0], pushes, node, depth + 1, 0))
            pushes += 1
    return tree


def tree_attention_mask(tree: DraftTree, cache_len: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[1, 1, n, cache_len + n] additive float mask: the whole cache, then ancestors only."""
    visible = torch.cat([torch.ones(len(tree), cache_len, dtype=torch.bool, device=device),
                         tree.ancestor_mask(device)], dim=1)
    mask = torch.zeros(visible.shape, dtype=dtype, device=device).masked_fill(~visible, torch.finfo(dtype).min)
    return mask[None, None]


@torch.inference_mode()
def ddtree_decode(drafter: DFlashDrafter, target: nn.Module, input_ids: torch.Tensor, max_new_tokens: int,
                  stop_token_ids: list[int] | None = None, budget: int = 32, keep_features: bool = False) -> DecodeResult:
    """Greedy tree speculative decoding of one prompt; `acceptance_lengths` (and `keep_features`) as in
    `dflash_decode`."""
    require_dflash_family(drafter)
    stops = StopTokens(stop_token_ids)
    begun = start_decoding(drafter, target, input_ids, max_new_tokens, stops, lambda logits: logits.argmax())
    input_ids, prompt_len, max_length, head = begun.input_ids, begun.prompt_len, begun.max_length, begun.head
    session, draft_cache, new_features, tokens = begun.session, begun.draft_cache, begun.new_features, begun.tokens
    dtype = next(target.parameters()).dtype
    start = prompt_len
    stopped = begun.stopped
    rounds: list[int] = []
    fed = [new_features]
    while not stopped and start + 1 < max_length:
        _, size = round_size(drafter, start, max_length)
        _, draft_hidden = draft_block(drafter, target, draft_cache, new_features, tokens[start], start, size)
        draft_logits = drafter.compute_logits(draft_hidden[0], head)
        tree = build_tree(tokens[start], torch.log_softmax(draft_logits.float(), dim=-1), budget)

        node_ids = torch.tensor([tree.tokens], device=input_ids.device)
        positions = start + torch.tensor(tree.depths, device=input_ids.device)
        mask = tree_attention_mask(tree, start, dtype, input_ids.device)
        target_logits, node_features = session.forward(node_ids, start, positions=positions, attention_mask=mask)
        path = tree.walk(target_logits.argmax(-1).tolist())
        bonus = int(target_logits[path[-1]].argmax())

        produced = [tree.tokens[node] for node in path[1:]] + [bonus]
        produced, stopped = stops.cut(produced[: max_length - start - 1])
        tokens.extend(produced)
        rounds.append(len(produced))
        kept = torch.tensor(path[: len(produced)], device=input_ids.device)  # root + accepted nodes
        session.keep_positions(start, kept)
        new_features = node_features[:, kept]
        fed += [new_features] if keep_features else []
        start += len(produced)

    output_ids = torch.tensor([tokens[:max_length]], device=input_ids.device)
    return DecodeResult(output_ids=output_ids, num_prompt_tokens=prompt_len, acceptance_lengths=rounds,
                        extra={"budget": budget, **({"features": torch.cat(fed, 1)} if keep_features else {})})

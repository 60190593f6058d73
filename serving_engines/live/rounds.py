"""Served rounds, counted the audit's way, and matched one by one against the audit's own rounds.

A round is one engine step after the prefill: the tokens it adds (accepted drafts + the bonus). The engine's
step s (s >= 1) verifies what step s - 1 drafted: its captured context is that block, `rejected` of which the
target refused, so it added `len(context) - rejected` tokens. The last step is never followed by another
capture: it added whatever the output holds beyond the earlier rounds (the output is cut at max_tokens and at a
stop token, as the audit cuts its rounds).
"""

from __future__ import annotations

from dataclasses import dataclass, field


def served_rounds(steps: list[dict], output_length: int) -> list[int]:
    """Tokens added per engine step after the prefill (bonus included), summing to `output_length - 1`."""
    left = output_length - 1  # the prefill step gave the first token
    rounds = []
    for step in steps[1:]:
        if left <= 0:
            break
        added = len(step["context_tokens"]) - sum(step["rejected"] or [0])
        rounds.append(min(added, left))
        left -= rounds[-1]
    if left > 0:
        rounds.append(left)
    return rounds


def served_drafts(steps: list[dict], rounds: int) -> list[list[int]]:
    """The block each served round verified: drafted by the step before it (request 0 of a batch of one)."""
    return [list(step["drafts"][0]) for step in steps[:rounds]]


def per_position(rounds: list[int], drafted: list[int]) -> list[float]:
    """Acceptance rate per draft position: position j is accepted in a round of length L when L - 1 > j,
    counted over the rounds that drafted at least j + 1 tokens."""
    longest = max(drafted, default=0)
    rates = []
    for j in range(longest):
        eligible = [length for length, n in zip(rounds, drafted, strict=True) if n > j]
        rates.append(round(sum(length - 1 > j for length in eligible) / len(eligible), 4) if eligible else 0.0)
    return rates


@dataclass
class RoundMatch:
    rounds_equal: int  # rounds whose length and drafted block are the audit's
    rounds: int  # rounds compared
    first_diff_round: int | None  # 1-based; None when every compared round agrees
    last_block_apart: bool  # rounds near the end differ only as the audit shrinks its block to the tokens left
    blocks_equal: int  # drafted blocks identical token for token
    apart: int = 0  # rounds counted apart (the audit's shrunk blocks)
    differing: list[int] = field(default_factory=list)  # 1-based rounds that differ (those apart excluded)


def match_rounds(served: list[int], served_blocks: list[list[int]], audited: list[int],
                 audited_blocks: list[list[int]], speculative_tokens: int) -> RoundMatch:
    """Round i of the engine against round i of the audit (length and drafted block). Near max_new_tokens the
    audit drafts fewer than K tokens (z-lab's `min(B, max_length - start)`) while the engine always drafts K and
    cuts the output: from the audit's first shrunk block on, rounds are counted apart, not as differences."""
    n = max(len(served), len(audited))
    shrunk_from = next((i for i, block in enumerate(audited_blocks) if len(block) < speculative_tokens), n)
    equal, blocks_equal, differing = 0, 0, []
    for i in range(min(n, shrunk_from)):
        s_block = served_blocks[i] if i < len(served_blocks) else None
        a_block = audited_blocks[i] if i < len(audited_blocks) else None
        same_block = s_block is not None and s_block == a_block
        blocks_equal += same_block
        same_length = i < len(served) and i < len(audited) and served[i] == audited[i]
        if same_length and same_block:
            equal += 1
        else:
            differing.append(i + 1)
    apart = n - min(n, shrunk_from) if not differing else 0
    if differing:  # after a real difference the later rounds are downstream of it: compared, not counted apart
        for i in range(shrunk_from, n):
            differing.append(i + 1)
    return RoundMatch(equal, n, differing[0] if differing else None, apart > 0, blocks_equal, apart, differing)

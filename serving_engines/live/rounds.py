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
    last_block_apart: bool  # the only difference is the last block, which the audit shrinks to the tokens left
    blocks_equal: int  # drafted blocks identical token for token
    differing: list[int] = field(default_factory=list)  # 1-based rounds that differ (the last block excluded)


def match_rounds(served: list[int], served_blocks: list[list[int]], audited: list[int],
                 audited_blocks: list[list[int]], speculative_tokens: int) -> RoundMatch:
    """Round i of the engine against round i of the audit (length and drafted block). A last audited block
    shorter than the engine's K is the audit's own shrinking near max_new_tokens, not a served difference."""
    n = max(len(served), len(audited))
    equal, blocks_equal, differing, apart = 0, 0, [], False
    for i in range(n):
        s_len = served[i] if i < len(served) else None
        a_len = audited[i] if i < len(audited) else None
        s_block = served_blocks[i] if i < len(served_blocks) else None
        a_block = audited_blocks[i] if i < len(audited_blocks) else None
        same_block = s_block is not None and a_block is not None and s_block == a_block
        blocks_equal += same_block
        if s_len == a_len and same_block:
            equal += 1
            continue
        shrunk = a_block is not None and len(a_block) < speculative_tokens and i == len(audited) - 1
        if shrunk and not differing:  # the audit drafted fewer tokens than the engine: counted apart
            apart = True
            continue
        differing.append(i + 1)
    return RoundMatch(equal, n, differing[0] if differing else None, apart, blocks_equal, differing)

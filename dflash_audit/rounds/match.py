"""A source's rounds against the audit's replay, round by round: which rounds are the same, the first that parts, and
acceptance per draft position.

A round is what one verification adds: its accepted proposals and the target's own token (the bonus), z-lab's
`acceptance_lengths`. Round i of the source is compared with round i of the replay, by length and, where the source
says which block it drafted, by that block token for token.
"""

from __future__ import annotations

from dataclasses import dataclass, field


def per_position(rounds: list[int], drafted: list[int], positions: int | None = None) -> list[float | None]:
    """Acceptance rate per draft position, the one definition every source's rounds are reported by: draft position j
    (0-based) is accepted in a round of length L (the bonus counted) when L - 1 > j, counted over the rounds that
    drafted at least j + 1 tokens (`drafted`: how many each round drafted). A round that drafted fewer (z-lab's loop
    shrinks its last blocks to the tokens left) is no rejection at the positions it did not draft. `positions`: how
    many positions to give (default: the most any round drafted); one that no round drafted is None (unknown)."""
    positions = max(drafted, default=0) if positions is None else positions
    rates: list[float | None] = []
    for j in range(positions):
        eligible = [length for length, n in zip(rounds, drafted, strict=True) if n > j]
        rates.append(sum(length - 1 > j for length in eligible) / len(eligible) if eligible else None)
    return rates


def first_difference(rounds: list[int], audited: list[int]) -> int | None:
    """The first round (1-based) whose length differs, one list running out included; None when every one agrees."""
    for i in range(max(len(rounds), len(audited))):
        if i >= len(rounds) or i >= len(audited) or rounds[i] != audited[i]:
            return i + 1
    return None


def round_of(position: int, rounds: list[int]) -> int:
    """The round that produced output position `position` (0: the prefill's token)."""
    total = 0
    for number, size in enumerate(rounds, 1):
        total += size
        if total >= position:
            return number
    return len(rounds)


@dataclass
class RoundMatch:
    rounds_equal: int  # rounds whose length (and drafted block, where known) are the audit's
    rounds: int  # rounds compared
    first_diff_round: int | None  # 1-based; None when every compared round agrees
    last_block_apart: bool  # rounds near the end differ only as the audit shrinks its block to the tokens left
    blocks_equal: int | None  # drafted blocks identical token for token (None: the source does not say its blocks)
    apart: int = 0  # rounds counted apart (the audit's shrunk blocks)
    differing: list[int] = field(default_factory=list)  # 1-based rounds that differ (those apart excluded)


def match_rounds(rounds: list[int], blocks: list[list[int]] | None, audited: list[int],
                 audited_blocks: list[list[int]], speculative_tokens: int) -> RoundMatch:
    """Round i of the source against round i of the audit (length, and the drafted block where the source gives it).

    Near max_new_tokens z-lab's loop drafts fewer than K tokens (`min(B, max_length - start)`) while an engine drafts
    K and cuts its output. Where the source gives its blocks, that shrink is seen by value: from the audit's first
    shrunk block on, rounds are counted apart, not as differences. Where it does not, only a replay drafting whole
    blocks can tell (the llama.cpp source's `final_block`), so every round is compared."""
    n = max(len(rounds), len(audited))
    # A source that shrinks its block as z-lab's loop does (an evaluator) is compared through those rounds too.
    shrunk_from = n if blocks is None else next(
        (i for i, block in enumerate(audited_blocks) if len(block) < speculative_tokens
         and (i >= len(blocks) or len(blocks[i]) != len(block))), n)
    equal, blocks_equal, differing = 0, 0, []
    for i in range(min(n, shrunk_from)):
        if blocks is None:
            same_block = True
        else:
            block = blocks[i] if i < len(blocks) else None
            same_block = block is not None and block == (audited_blocks[i] if i < len(audited_blocks) else None)
            blocks_equal += same_block
        same_length = i < len(rounds) and i < len(audited) and rounds[i] == audited[i]
        if same_length and same_block:
            equal += 1
        else:
            differing.append(i + 1)
    apart = n - min(n, shrunk_from) if not differing else 0
    if differing:  # after a real difference the later rounds are downstream of it: compared, not counted apart
        differing += list(range(shrunk_from + 1, n + 1))
    return RoundMatch(equal, n, differing[0] if differing else None, apart > 0,
                      None if blocks is None else blocks_equal, apart, differing)

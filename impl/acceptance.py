"""Acceptance lengths summed up: per-prompt τ and the histogram (no model code, so a verb that only checks
its inputs, or prints results, does not import the decoding loops)."""

from __future__ import annotations

# τ along the context's bin width by default, in tokens (speculators' acceptance_report.py DEFAULT_POSITION_BIN_SIZE);
# `--tau-bin-tokens` sets it on every τ report (dflash_audit/tau/along_context.py).
POSITION_BIN_TOKENS = 256


def mean_acceptance(lengths: list[int]) -> float:
    """Per-prompt τ: the mean acceptance length over rounds (0 when no round ran)."""
    return sum(lengths) / len(lengths) if lengths else 0.0


def acceptance_histogram(lengths: list[int], longest: int) -> list[int]:
    """Counts of acceptance lengths 0..`longest`, as z-lab's benchmark prints them (`longest` = the drafter's
    speculative tokens + 1: B for the anchor-as-bonus layout, B + 1 for sample-from-anchor).

    A length outside 0..longest cannot come from a correct decoder: it is an error, never clamped."""
    counts = [0] * (longest + 1)
    for length in lengths:
        if not 0 <= length <= longest:
            raise ValueError(f"acceptance length {length} outside 0..{longest} (the longest round)")
        counts[length] += 1
    return counts

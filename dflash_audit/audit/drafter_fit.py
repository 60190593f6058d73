"""Whether a drafter fits a target: its spec (impl/target_fit.py) and, for a reduced draft vocabulary, a usable
draft-to-target map. The one check `eval` (which refuses a drafter that does not fit) and `compare` (which then
leaves its τ unmeasured) share."""

from __future__ import annotations

from dflash_audit.audit.sides import Side
from dflash_audit.audit.static_vocab import mapping_problem
from impl.target_fit import spec_misfit


def misfit(side: Side, hidden_size: int, depth: int, vocab_size: int) -> str | None:
    """Why `side`'s drafter cannot run against a target of this hidden size, decoder depth and vocabulary, or None."""
    why = spec_misfit(side.spec, hidden_size, depth, vocab_size)
    if why is not None:
        return why
    unmapped = mapping_problem(side)
    if unmapped is not None:  # the static draft_vocab finding says what is wrong; no run would be the drafter's
        return (f"its reduced head of {unmapped[0]} tokens has no usable draft-to-target map "
                f"({'; '.join(unmapped[2])})")
    return None

"""Whether a drafter fits a target: its hidden size, the target depth it was built for, its vocabulary and, for a
reduced draft vocabulary, a usable draft-to-target map. The one check `eval` (which refuses a drafter that does
not fit) and `compare` (which then leaves its τ unmeasured) share."""

from __future__ import annotations

from dflash_audit.audit.sides import Side
from dflash_audit.audit.static_vocab import mapping_problem


def misfit(side: Side, hidden_size: int, depth: int, vocab_size: int) -> str | None:
    """Why `side`'s drafter cannot run against a target of this hidden size, decoder depth and vocabulary, or None."""
    spec = side.spec
    if spec.hidden_size != hidden_size:
        return f"hidden size {spec.hidden_size} but the target's is {hidden_size}"
    if spec.num_target_layers != depth:
        return f"built for a target of {spec.num_target_layers} layers, this one has {depth}"
    if spec.vocab_size != vocab_size:
        return f"vocabulary of {spec.vocab_size} but the target's is {vocab_size}"
    unmapped = mapping_problem(side)
    if unmapped is not None:  # the static draft_vocab finding says what is wrong; no run would be the drafter's
        return (f"its reduced head of {unmapped[0]} tokens has no usable draft-to-target map "
                f"({'; '.join(unmapped[2])})")
    return None

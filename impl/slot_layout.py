"""The slot layout of a DFlash block (`sample_from_anchor`), the one home of its rules.

A block is `[anchor, mask x (B-1)]` at positions `a .. a+B-1`, the anchor being the last
known token. The two layouts differ in which slots propose and what each proposes:
- False (DFlash, speculators' and z-lab's default): slot 0 holds the anchor and proposes
  nothing; slot k >= 1 proposes the token AT its own position `a + k`, so it is trained
  toward the verifier logits computed at `a + k - 1`. A block yields B - 1 speculative tokens.
- True (DSpark, speculators' `sample_from_anchor`, vLLM's DSpark runner): every slot proposes
  the NEXT token, slot k the token at `a + k + 1`, trained toward the verifier logits at
  `a + k`. A block yields B speculative tokens.
"""

from __future__ import annotations


def first_proposing_slot(sample_from_anchor: bool) -> int:
    """The first block slot whose logits propose a token (and carry a loss): 0 or 1."""
    return 0 if sample_from_anchor else 1


def speculative_tokens(block_size: int, sample_from_anchor: bool) -> int:
    """Tokens one block proposes: B with sample-from-anchor, else B - 1."""
    return block_size - first_proposing_slot(sample_from_anchor)


def target_shift(sample_from_anchor: bool) -> int:
    """Slot k at position p is trained toward the verifier logits at p - shift."""
    return first_proposing_slot(sample_from_anchor)


def draft_block_size(proposals: int, sample_from_anchor: bool) -> int:
    """The block (anchor + masks) a round drafts to get `proposals` tokens."""
    return proposals + first_proposing_slot(sample_from_anchor)


def longest_round(block_size: int, sample_from_anchor: bool) -> int:
    """The longest round: every proposal accepted plus the target's bonus token."""
    return speculative_tokens(block_size, sample_from_anchor) + 1


def describe(sample_from_anchor: bool) -> str:
    return ("sample_from_anchor (DSpark): slot k proposes the token at anchor + k + 1, B proposals per block"
            if sample_from_anchor else
            "anchor as the bonus (DFlash): slot k >= 1 proposes the token at anchor + k, B - 1 proposals per block")

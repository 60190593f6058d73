"""A token id of a vocabulary of N tokens is one of 0..N-1: the one statement of that rule, for single ids and for
tensors of them (data, mask tokens, draft-to-target maps, embedding rows)."""

from __future__ import annotations


def is_token_id(token_id: int, vocab_size: int) -> bool:
    return 0 <= token_id < vocab_size


def outside_vocabulary(ids, vocab_size: int):
    """Elementwise, for a tensor of ids: True where an id is not a token id of this vocabulary."""
    return (ids < 0) | (ids >= vocab_size)

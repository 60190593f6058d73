"""Which target layers feed the drafter, and the two conventions for naming them.

z-lab: id = 0-based decoder layer whose output is used, read as `hidden_states[id + 1]`
(`hidden_states[0]` is the embedding output). This is our canonical convention.
speculators: `aux_hidden_state_layer_ids` are already shifted by one (id + 1), and its
converter drops the id that would name the final layer (the final layer's output is
captured separately as `verifier_last_hidden_states`).

This module is the only place the shift is written; every other module calls
`hidden_state_index`, `layer_at_index`, `names_final_layer`, `zlab_to_speculators` or `speculators_to_zlab`; the final layer
and the layer range are written here too (`final_layer`, `layers_outside`)
(tests/test_restatements.py fails on a copy).
"""

from __future__ import annotations


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """z-lab's default: evenly spaced from layer 1 to layer N-3 (N=64, n=5 -> [1, 16, 31, 46, 61])."""
    if num_target_layers <= 0 or num_draft_layers <= 0:
        raise ValueError(f"need positive layer counts, got N={num_target_layers}, n={num_draft_layers}")
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    return [round(start + i * (end - start) / (num_draft_layers - 1)) for i in range(num_draft_layers)]


def final_layer(num_target_layers: int) -> int:
    """z-lab id of the target's final decoder layer: where the reference recipe's targets come from."""
    return num_target_layers - 1


def layer_range(num_target_layers: int) -> str:
    """The ids a target's decoder layers have, in words."""
    return f"the target's decoder layers 0..{final_layer(num_target_layers)}"


def is_layer_id(layer_id: int, num_target_layers: int) -> bool:
    """Whether `layer_id` names one of the target's decoder layers 0..N-1."""
    return 0 <= layer_id < num_target_layers


def layers_outside(layer_ids, num_target_layers: int) -> str | None:
    """"[ids] outside the target's decoder layers 0..N-1" for the ids that name no decoder layer, or None."""
    bad = [i for i in layer_ids if not is_layer_id(i, num_target_layers)]
    return f"{bad} outside {layer_range(num_target_layers)}" if bad else None


def hidden_state_index(layer_id: int) -> int:
    """Where z-lab id `layer_id` sits in a Hugging Face `output_hidden_states` tuple, whose
    entry 0 is the embedding output. speculators' aux id for the same layer is this index."""
    return layer_id + 1


def layer_at_index(index: int) -> int:
    """The z-lab id whose output sits at `hidden_states[index]` (the inverse of `hidden_state_index`); -1 names the
    embedding output, index 0."""
    return index - 1


def names_final_layer(layer_id: int, num_target_layers: int) -> bool:
    """Whether z-lab id `layer_id` is the target's final decoder layer (speculators never feeds it to fc)."""
    return hidden_state_index(layer_id) == num_target_layers


def zlab_to_speculators(layer_ids: list[int], num_target_layers: int) -> list[int]:
    """z-lab id i -> speculators aux id i + 1; an id naming the final layer is dropped, as speculators does."""
    return [hidden_state_index(i) for i in layer_ids if not names_final_layer(i, num_target_layers)]


def speculators_to_zlab(aux_layer_ids: list[int]) -> list[int]:
    """speculators aux id j -> z-lab id j - 1; ValueError for an id below 1 (the embedding output)."""
    if any(j < 1 for j in aux_layer_ids):
        raise ValueError(f"speculators aux ids start at 1 (0 is the embedding output), got {aux_layer_ids}")
    return [j - 1 for j in aux_layer_ids]

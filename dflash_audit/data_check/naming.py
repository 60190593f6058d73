"""Each stored layer named by value: the target recomputed on the record's own token ids gives every state a writer
may have stored (each depth's raw output, the last layer after the final norm, each depth through the final norm),
and a stored [T, H] tensor is the candidate it equals within the by-value core's tolerance
(dflash_audit/target_values.py: `name_among`, `tolerance`, the states from its `TargetReplay`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dflash_audit.target_values import Candidate, Named, TargetReplay, name_among, tolerance
from impl.layers import layer_at_index


@dataclass(frozen=True)
class State:
    """A candidate's place: `depth` in vLLM's numbering (dflash_audit/data_check/claims.py), `normed` through the
    target's final norm."""
    depth: int
    normed: bool


def describe_depth(depth: int, layers: int, normed: bool = False) -> str:
    if depth == 0:
        return "the embeddings"
    what = f"the output of decoder layer {layer_at_index(depth)}"
    if depth == layers:
        what += " (the last)"
    return what + (" after the final norm" if normed else (" before the final norm" if depth == layers else ""))


class StateBank:
    """The target's candidate states on one record's tokens ([T, H] each, float32), each made when a name is scored,
    from one replay whose states are read a layer at a time."""

    def __init__(self, target, token_ids: list[int]):
        replay = TargetReplay(target, token_ids)
        self.layers = replay.layers
        norm = target.get_decoder().norm
        dtype = next(target.parameters()).dtype

        def raw(depth: int) -> torch.Tensor:  # depth 0..N: the embeddings, each layer's raw output
            return replay.pre_norm if depth == self.layers else replay.hidden[depth]

        def normed(depth: int) -> torch.Tensor:
            with torch.inference_mode():
                return norm(raw(depth).to(dtype)).float()

        self.bank: dict[Candidate, object] = {}
        self.places: dict[Candidate, State] = {}
        for depth in range(self.layers + 1):
            self.add(State(depth, False), lambda depth=depth: raw(depth))
        self.add(State(self.layers, True), lambda: replay.hidden[self.layers])
        for depth in range(1, self.layers):  # a writer that put every captured layer through the final norm
            self.add(State(depth, True), lambda depth=depth: normed(depth))
        self.tokens = len(token_ids)

    def add(self, state: State, make) -> None:
        candidate = Candidate(describe_depth(state.depth, self.layers, state.normed), state.depth,
                              layer_at_index(state.depth) if state.depth else None, state.normed, "hidden")
        self.bank[candidate] = make
        self.places[candidate] = state

    def name(self, rows: torch.Tensor, dtype: str, offset: int = 0) -> tuple[Named, State | None]:
        """`rows` [r, H] stored for positions offset..offset + r - 1, named by the candidate it equals."""
        positions = torch.arange(offset, offset + rows.shape[0])
        named = name_among(rows.float(), self.bank, tolerance(dtype), positions)
        return named, self.places.get(named.candidate) if named.equal else None

"""Each stored layer named by value: the target recomputed on the record's own token ids gives every state a writer
may have stored (each depth's raw output, the last layer after the final norm, each depth through the final norm),
and a stored [T, H] tensor is the candidate it equals within the matcher's tolerance (dflash_audit/trace/matcher.py:
`name_rows`, `tolerance`; the states from the live check's `TargetReplay`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dflash_audit.trace.matcher import Candidate, Named, name_rows, tolerance
from dflash_audit.rounds.by_value import TargetReplay
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
    """The target's candidate states on one record's tokens ([T, H] each, float32, on the CPU)."""

    def __init__(self, target, token_ids: list[int]):
        replay = TargetReplay(target, token_ids)
        self.layers = replay.layers
        norm = target.get_decoder().norm
        device, dtype = replay.pre_norm.device, next(target.parameters()).dtype
        raw = [replay.hidden[d] for d in range(self.layers)] + [replay.pre_norm]  # depth 0..N
        self.bank: dict[Candidate, torch.Tensor] = {}
        self.places: dict[Candidate, State] = {}
        for depth, tensor in enumerate(raw):
            self.add(State(depth, False), tensor)
        self.add(State(self.layers, True), replay.hidden[self.layers])
        with torch.inference_mode():
            for depth in range(1, self.layers):  # a writer that put every captured layer through the final norm
                self.add(State(depth, True), norm(raw[depth].to(device, dtype)).float())
        self.tokens = len(token_ids)

    def add(self, state: State, tensor: torch.Tensor) -> None:
        candidate = Candidate(describe_depth(state.depth, self.layers, state.normed), state.depth,
                              layer_at_index(state.depth) if state.depth else None, state.normed, "hidden")
        self.bank[candidate] = tensor.float().cpu()
        self.places[candidate] = state

    def name(self, rows: torch.Tensor, dtype: str, offset: int = 0) -> tuple[Named, State | None]:
        """`rows` [r, H] stored for positions offset..offset + r - 1, named by the candidate it equals."""
        positions = torch.arange(offset, offset + rows.shape[0])
        named = name_rows(rows, self.bank, tolerance(dtype), positions)
        return named, self.places.get(named.candidate) if named.equal else None

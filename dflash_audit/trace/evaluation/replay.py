"""The audit's side of an evaluation: z-lab's own `dflash_generate` replayed on the evaluator's prompts with the
same drafter weights and target (its rounds and each round's verified block, read by a hook on the target's calls,
nothing of z-lab's loop changed), and the target's tensors a drafter may have been fed instead of z-lab's features,
each named (every hidden state, each after the final norm, the last layer before it)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from dflash_audit.audit.context_faults import ContextFault, DrafterShape
from dflash_audit.target_values import SAME, LazyStates, TargetReplay, relative_rows
from impl.layers import final_layer, hidden_state_index, names_final_layer


@dataclass
class ReplayRound:
    start: int
    block: list[int]
    produced: int


@dataclass
class Replay:
    rounds: list[ReplayRound]
    output: list[int]
    stopped: bool  # ended at a stop id

    @property
    def lengths(self) -> list[int]:
        return [r.produced for r in self.rounds]


def zlab_replay(twin, target, prompt: list[int], max_new_tokens: int, stop_ids: list[int] | None,
                temperature: float = 0.0, seed: int = 0) -> Replay:
    """z-lab's `dflash_generate` on one prompt; each round's block as its verification call fed it."""
    from reference_adapters.zlab_adapter import zlab_generate

    blocks: list[list[int]] = []

    def keep(module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        blocks.append(ids[0].tolist())

    handle = target.register_forward_pre_hook(keep, with_kwargs=True)
    try:
        if temperature > 0:
            torch.manual_seed(seed)
        ids = torch.tensor([prompt], device=target.device)
        stats = zlab_generate(twin, target, ids, max_new_tokens, stop_ids, temperature)
    finally:
        handle.remove()
    output = stats.output_ids[0].tolist()
    rounds, start = [], len(prompt)
    for block, produced in zip(blocks[1:], stats.acceptance_lengths):
        rounds.append(ReplayRound(start, block, int(produced)))
        start += int(produced)
    stopped = bool(stop_ids) and any(t in stop_ids for t in output[len(prompt):])
    return Replay(rounds, output, stopped)


class TargetStates:
    """The target's tensors on one token sequence, by name: what a drafter may have been fed as a layer's feature.
    Each is made when asked for, from one replay whose states are read a layer at a time (the by-value core's)."""

    def __init__(self, target, tokens: list[int]):
        self.replay = TargetReplay(target, tokens)
        # hidden_states[i] when indexed, [t, H] float32 on the CPU, where the evaluator's captures are held
        self.hidden = LazyStates(self.replay.run, cpu=True)
        self.layers = self.replay.layers
        self.norm = target.get_decoder().norm
        self.dtype = next(target.parameters()).dtype

    @property
    def pre_norm(self) -> torch.Tensor:
        return self.replay.pre_norm.cpu()

    def feature(self, layer_id: int) -> torch.Tensor:
        """z-lab's feature of target layer `layer_id`: hidden_states[layer_id + 1] (`extract_context_feature`)."""
        return self.hidden[hidden_state_index(layer_id)]

    def _normed(self, t: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode():
            return self.norm(t.to(self.replay.device, self.dtype)).float().cpu()

    def named_states(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every candidate, one at a time: each hidden state, each after the final norm, the last layer's output
        before it, the final norm applied twice."""
        yield "the token embeddings (hidden_states[0])", self.hidden[0]
        for layer in range(self.layers):
            last = names_final_layer(layer, self.layers)
            index = hidden_state_index(layer)
            state = self.hidden[index]
            yield (f"the output of layer {layer} (hidden_states[{index}]"
                   f"{', after the final norm' if last else ''})"), state
            if not last:
                yield f"the output of layer {layer} after the final norm", self._normed(state)
        yield f"the output of layer {final_layer(self.layers)} before the final norm", self.pre_norm
        yield f"the output of layer {self.layers - 1} with the final norm applied twice", self._normed(self.hidden[-1])

    def name_rows(self, rows: torch.Tensor, positions: list[int]) -> tuple[str | None, int]:
        """The candidate the rows equal at `positions`, or shifted by a constant (its shift); (None, 0): none."""
        for shift in (0, -1, 1, -2, 2):
            at = [p + shift for p in positions]
            if min(at) < 0 or max(at) >= self.replay.run.positions:
                continue
            for name, tensor in self.named_states():
                if relative_rows(rows.float().cpu(), tensor[at]) <= SAME:
                    return name, shift
        return None, 0


def plain_inv_freq(head_dims: int, theta: float) -> torch.Tensor:
    """The rotary frequencies of plain (unscaled) RoPE at base `theta` over `head_dims` rotated dimensions."""
    return 1.0 / (theta ** (torch.arange(0, head_dims, 2, dtype=torch.float64) / head_dims))


def drafter_shape(twin, declared_lengths: tuple[tuple[int, str], ...] = ()) -> DrafterShape:
    """What the long-context faults need of z-lab's drafter: its windows, block, and its rotary base where its
    rotary embedding is plain RoPE at the config's (nested) rope_theta (else None: no theta change is tried)."""
    rotary = twin.rotary_emb
    parameters = getattr(twin.config, "rope_parameters", None) or {}
    theta = parameters.get("rope_theta", getattr(twin.config, "rope_theta", None))
    inv = rotary.inv_freq.detach().double().cpu()
    plain = theta is not None and parameters.get("rope_type", "default") == "default" and torch.allclose(
        inv, plain_inv_freq(2 * inv.shape[0], float(theta)), rtol=1e-5)
    return DrafterShape(tuple(layer.self_attn.sliding_window for layer in twin.layers), int(twin.block_size),
                        float(theta) if plain else None, declared_lengths)


@contextmanager
def changed(twin, fault: ContextFault | None):
    """z-lab's drafter with a long-context fault's change to the drafter itself: every sliding layer's window
    taken off, or its rotary base replaced (what an evaluator so faulted computes)."""
    saved = [(layer.self_attn, layer.self_attn.sliding_window) for layer in twin.layers]
    rotary = twin.rotary_emb
    inv_freq = rotary.inv_freq
    try:
        if fault is not None and fault.windows_off:
            for attn, _ in saved:
                attn.sliding_window = None
        if fault is not None and fault.rope_theta is not None:
            rotary.inv_freq = plain_inv_freq(2 * inv_freq.shape[0], fault.rope_theta).to(inv_freq.device,
                                                                                        inv_freq.dtype)
        yield
    finally:
        for attn, window in saved:
            attn.sliding_window = window
        rotary.inv_freq = inv_freq


def faulted_output(twin, target, features: torch.Tensor, block: list[int], start: int,
                   fault: ContextFault | None = None) -> torch.Tensor:
    """z-lab's drafter at an anchor at `start` on z-lab's inputs (`features`: the `start` context rows), with a
    long-context fault's changes: the context cut to its last rows, the block's positions moved, the drafter
    changed."""
    keep = start if fault is None or fault.keep_rows is None else min(start, fault.keep_rows)
    shift = 0 if fault is None else fault.block_shift
    positions = list(range(start - keep, start)) + [start + shift + k for k in range(len(block))]
    with changed(twin, fault):
        return drafter_output(twin, target, features[start - keep: start], block, positions)


def drafter_output(twin, target, features: torch.Tensor, block: list[int], positions: list[int]) -> torch.Tensor:
    """z-lab's drafter run fresh (no cache) on context features, a block and positions: its output rows [B, H]."""
    from reference_adapters.zlab_adapter import zlab

    device = target.device
    dtype = next(twin.parameters()).dtype
    ids = torch.tensor([block], device=device)
    with torch.inference_mode():
        noise = zlab._raw_input_embeddings(target, ids,
                                           float(zlab._draft_value(twin.config, "input_embedding_scale", 1.0)))
        out = twin(target_hidden=features[None].to(device, dtype), noise_embedding=noise.to(dtype),
                   position_ids=torch.tensor([positions], device=device))
    return out[0].float().cpu()


def drafter_logits(twin, target, hidden: torch.Tensor) -> torch.Tensor:
    from reference_adapters.zlab_adapter import zlab

    with torch.inference_mode():
        return twin.compute_logits(hidden.to(target.device, next(twin.parameters()).dtype),
                                   zlab._output_head(target)).float().cpu()

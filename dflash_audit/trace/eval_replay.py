"""The audit's side of an evaluation: z-lab's own `dflash_generate` replayed on the evaluator's prompts with the
same drafter weights and target (its rounds and each round's verified block, read by a hook on the target's calls,
nothing of z-lab's loop changed), and the target's tensors a drafter may have been fed instead of z-lab's features,
each named (every hidden state, each after the final norm, the last layer before it)."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch

from dflash_audit.trace.eval_rounds import SAME
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
    """The target's tensors on one token sequence, by name: what a drafter may have been fed as a layer's feature."""

    def __init__(self, target, tokens: list[int]):
        captured = {}
        decoder = target.get_decoder()
        handle = decoder.norm.register_forward_pre_hook(lambda m, args: captured.update(pre=args[0]))
        try:
            with torch.inference_mode():
                out = target(torch.tensor([tokens], device=target.device), output_hidden_states=True)
        finally:
            handle.remove()
        self.hidden = [h[0].float().cpu() for h in out.hidden_states]
        self.layers = len(self.hidden) - 1
        self.pre_norm = captured["pre"][0].float().cpu()
        self.norm = decoder.norm
        self.device = target.device
        self.dtype = next(target.parameters()).dtype
        self._named: dict[str, torch.Tensor] | None = None

    def feature(self, layer_id: int) -> torch.Tensor:
        """z-lab's feature of target layer `layer_id`: hidden_states[layer_id + 1] (`extract_context_feature`)."""
        return self.hidden[hidden_state_index(layer_id)]

    def _normed(self, t: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode():
            return self.norm(t.to(self.device, self.dtype)).float().cpu()

    def named(self) -> dict[str, torch.Tensor]:
        """Every candidate: each hidden state, each after the final norm, the last layer's output before it."""
        if self._named is None:
            named = {"the token embeddings (hidden_states[0])": self.hidden[0]}
            for layer in range(self.layers):
                last = names_final_layer(layer, self.layers)
                index = hidden_state_index(layer)
                named[f"the output of layer {layer} (hidden_states[{index}]"
                      f"{', after the final norm' if last else ''})"] = self.hidden[index]
                if not last:
                    named[f"the output of layer {layer} after the final norm"] = self._normed(self.hidden[index])
            named[f"the output of layer {final_layer(self.layers)} before the final norm"] = self.pre_norm
            named[f"the output of layer {self.layers - 1} with the final norm applied twice"] = \
                self._normed(self.hidden[-1])
            self._named = named
        return self._named

    def name_rows(self, rows: torch.Tensor, positions: list[int]) -> tuple[str | None, int]:
        """The candidate the rows equal at `positions`, or shifted by a constant (its shift); (None, 0): none."""
        rows = rows.float().cpu()
        for shift in (0, -1, 1, -2, 2):
            at = [p + shift for p in positions]
            if min(at) < 0 or max(at) >= self.hidden[0].shape[0]:
                continue
            for name, tensor in self.named().items():
                if relative_rows(rows, tensor[at]) <= SAME:
                    return name, shift
        return None, 0


def relative_rows(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest row-wise relative difference (each row against its own scale)."""
    scale = b.abs().amax(-1).clamp_min(1e-12)
    return float(((a - b).abs().amax(-1) / scale).max())


@contextmanager
def window_off(twin):
    """z-lab's drafter with every sliding layer's window taken off (what an evaluator ignoring it computes)."""
    saved = [(layer.self_attn, layer.self_attn.sliding_window) for layer in twin.layers]
    try:
        for attn, _ in saved:
            attn.sliding_window = None
        yield
    finally:
        for attn, window in saved:
            attn.sliding_window = window


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

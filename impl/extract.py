"""One target forward pass -> the drafter's context features and the verifier's final state.

Context features: `cat([hs[id + 1] for id in target_layer_ids], -1)` (z-lab indexing).
Final state: the *raw* output of the last decoder layer, captured with a forward hook.
Never `hs[-1]`: in transformers 5.x it is already `model.norm(raw)`, so feeding it to
the verifier norm again would normalise twice.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from foundation.placement import target_device
from impl.layers import final_layer, hidden_state_index, layers_outside


def decoder_layers(target: nn.Module) -> nn.ModuleList:
    """The decoder layer stack of a Hugging Face causal LM (`model.model.layers`)."""
    body = target.get_decoder() if hasattr(target, "get_decoder") else getattr(target, "model", target)
    layers = getattr(body, "layers", None)
    if layers is None:
        raise ValueError(f"{type(target).__name__} has no decoder layer stack at .model.layers")
    return layers


def final_norm(target: nn.Module) -> nn.Module:
    body = target.get_decoder() if hasattr(target, "get_decoder") else target.model
    return body.norm


def output_head(target: nn.Module) -> nn.Module:
    head = getattr(target, "lm_head", None)
    return head if head is not None else target.get_output_embeddings()


def context_features(hidden_states: tuple[torch.Tensor, ...], layer_ids: list[int]) -> torch.Tensor:
    """Concatenate the outputs of the selected decoder layers (z-lab indexing), on the device of
    the embedding output: a target sharded over devices hands each layer's output over on its own."""
    device = hidden_states[0].device
    return torch.cat([hidden_states[hidden_state_index(i)].to(device) for i in layer_ids], dim=-1)


@dataclass
class TargetStates:
    context: torch.Tensor  # [b, t, len(layer_ids) * H]
    final_raw: torch.Tensor  # [b, t, H] raw output of the last decoder layer
    source: torch.Tensor  # [b, t, H] raw output of the layer chosen to give targets
    logits: torch.Tensor | None  # [b, t, V] the target's own logits (post-norm head)


class HiddenStateExtractor:
    """Runs the target once and returns everything a drafter needs from it."""

    def __init__(self, target: nn.Module, layer_ids: list[int], source_layer: int | None = None):
        self.target = target
        self.layer_ids = list(layer_ids)
        self.num_layers = len(decoder_layers(target))
        # None -> the final decoder layer, the reference recipe.
        self.source_layer = final_layer(self.num_layers) if source_layer is None else source_layer
        outside = layers_outside([*self.layer_ids, self.source_layer], self.num_layers)
        if outside:
            raise ValueError(f"layer ids {outside}")

    @torch.no_grad()
    def __call__(self, input_ids: torch.Tensor, with_logits: bool = False, **forward_kwargs) -> TargetStates:
        captured: dict[str, torch.Tensor] = {}

        def keep_raw_output(_module, _inputs, output):
            captured["final_raw"] = output[0] if isinstance(output, tuple) else output

        handle = decoder_layers(self.target)[-1].register_forward_hook(keep_raw_output)
        try:
            out = self.target(input_ids.to(target_device(self.target)), output_hidden_states=True, use_cache=False,
                              logits_to_keep=0 if with_logits else 1, **forward_kwargs)
        finally:
            handle.remove()
        hs = out.hidden_states
        final_raw = captured["final_raw"].to(hs[0].device)  # the last shard's device otherwise
        # Intermediate layer outputs are raw in hs; the final one only via the hook.
        source = (final_raw if self.source_layer == final_layer(self.num_layers)
                  else hs[hidden_state_index(self.source_layer)].to(hs[0].device))
        return TargetStates(context=context_features(hs, self.layer_ids), final_raw=final_raw, source=source,
                            logits=out.logits if with_logits else None)

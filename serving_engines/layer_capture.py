"""Which tensor feeds the drafter for each declared target layer: in training, and in each engine.

Training (z-lab's trainer, speculators' offline data as the audit reads it, ours) reads transformers'
`hidden_states[id + 1]`: the residual stream after layer `id`, and for the target's last layer that entry is the
final norm's output. The engines capture inside their own forward (read from the installed source; the live check,
`serve-check --live`, observes the same in a running vLLM):
- vLLM adds `hidden_states + residual` after each captured layer (interfaces.py `_maybe_add_hidden_state`, called
  after every decoder layer): after layer `id`, and for the last layer *before* the final norm;
- SGLang captures *before* layer `id + 1` (qwen3.py `if i in self.layers_to_capture`, inside the layer loop): after
  layer `id`, and for the last layer nothing (there is no layer `id + 1`).
"""

from __future__ import annotations

from impl.layers import hidden_state_index, is_layer_id, names_final_layer


def _after(layer_id: int) -> str:
    return f"after layer {layer_id}"


def trained_capture(layer_ids: list[int] | None, num_layers: int | None) -> list[str] | None:
    if layer_ids is None or num_layers is None:
        return None
    return [_after(i) + (", after the final norm" if names_final_layer(i, num_layers) else "") for i in layer_ids]


EMBEDDING = "the embedding output"  # z-lab id -1: aux id 0, what both engines capture before layer 0


def vllm_capture(layer_ids: list[int] | None, num_layers: int | None) -> list[str] | None:
    """(vLLM adds aux id j after layer j - 1, and j = 0 before layer 0: any other j is never captured.)"""
    if layer_ids is None or num_layers is None:
        return None
    return [EMBEDDING if i == -1 else f"not captured (the target has no layer {i})" if not is_layer_id(i, num_layers)
            else _after(i) + (", before the final norm" if names_final_layer(i, num_layers) else "")
            for i in layer_ids]


def sglang_capture(layer_ids: list[int] | None, num_layers: int | None) -> list[str] | None:
    if layer_ids is None or num_layers is None:
        return None
    return [EMBEDDING if i == -1 else f"not captured (the target has no layer {i})" if not is_layer_id(i, num_layers)
            else f"not captured (captured before layer {hidden_state_index(i)}, which does not exist)"
            if names_final_layer(i, num_layers) else _after(i) for i in layer_ids]

"""SpecForge 0.2.0 behind a plug written against interface 1 (impl/interface_versions.py), as a plug author would
have written it then: no `interface_version` (versions were not named yet), a recipe of `gamma`, `loss_kind`,
`max_anchors`, `noise_std`, `training_outputs` without `anchors`, `loss(..., kind, ...)`, `generate` without
`temperature`/`seed`, and none of the operations later versions added (D-PACE, DFlash2, slot layout, rotary,
draft vocabulary). Every operation it does have is held/specforge.py's own, so what SpecForge computes is
unchanged: run under today's suite it must get plug mismatches for what it cannot take, never divergences
beyond SpecForge's known ones.
"""

from __future__ import annotations

from dataclasses import dataclass

from held.specforge import SpecForgeImplementation, default_recipe


@dataclass(frozen=True)
class SpecForgeRecipeV1:
    gamma: float | None
    loss_kind: str
    max_anchors: int
    noise_std: float = 0.0


class SpecForgeInterface1:
    name = "specforge-interface-1"
    unsupported: frozenset[str] = frozenset({"inference_mask", "block_metrics"})

    def __init__(self):
        current = default_recipe()
        self.recipe = SpecForgeRecipeV1(gamma=current.gamma, loss_kind=current.loss_fn, max_anchors=current.max_anchors)
        self._today = SpecForgeImplementation()

    def default_target_layer_ids(self, num_target_layers, num_draft_layers):
        return self._today.default_target_layer_ids(num_target_layers, num_draft_layers)

    def context_features(self, hidden_states, layer_ids):
        return self._today.context_features(hidden_states, layer_ids)

    def select_anchors(self, loss_mask, max_anchors, block_size, seed):
        return self._today.select_anchors(loss_mask, max_anchors, block_size, seed)

    def training_mask(self, document_ids, anchors, block_size, sliding_window, causal_block):
        return self._today.training_mask(document_ids, anchors, block_size, sliding_window, causal_block)

    def inference_mask(self, context_len, block_len, sliding_window, causal):
        return self._today.inference_mask(context_len, block_len, sliding_window, causal)

    def build_drafter(self, spec, state_dict, target=None):
        return self._today.build_drafter(spec, state_dict, target)

    def project_context(self, drafter, context_features):
        return self._today.project_context(drafter, context_features)

    def draft_forward(self, drafter, noise_embedding, target_hidden, position_ids):
        return self._today.draft_forward(drafter, noise_embedding, target_hidden, position_ids)

    def training_outputs(self, drafter, target, input_ids, loss_mask, document_ids, max_anchors, seed):
        return self._today.training_outputs(drafter, target, input_ids, loss_mask, document_ids, max_anchors, seed)

    def loss_weights(self, block_size, gamma, sample_from_anchor):
        return self._today.loss_weights(block_size, gamma, sample_from_anchor)

    def loss(self, logits, targets, loss_mask, block_size, gamma, kind, sample_from_anchor):
        return self._today.loss(logits, targets, loss_mask, block_size, gamma, kind, sample_from_anchor)

    def block_metrics(self, logits, targets, loss_mask, block_size):
        return self._today.block_metrics(logits, targets, loss_mask, block_size)

    def generate(self, drafter, target, input_ids, max_new_tokens, stop_token_ids):
        return self._today.generate(drafter, target, input_ids, max_new_tokens, stop_token_ids)

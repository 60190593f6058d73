"""`impl/` behind the shared `DFlashImplementation` interface (the conformance suite's `ours`)."""

from __future__ import annotations

import torch
from torch import nn

import impl.model
from foundation.placement import built_for
from impl import anchors as anchor_rules
from impl import decoding, dflash2, layers, losses, masks, slot_layout, vocab_mapping
from impl.body_shapes import build_drafter
from impl.decoding import Sampler, dflash_decode
from impl.dspark import confidence_features, draft_left_to_right
from impl.extract import context_features, output_head
from impl.interface import INTERFACE_VERSION, GenerationResult, TrainingOutputs
from impl.model import DFlashDrafter, DraftCache
from impl.recipe import Recipe
from impl.recipe import train_recipe
from impl.spec import DraftSpec
from impl.train_step import training_step
from impl.xpress import jacobi_resolve


class OursImplementation:
    name = "ours"
    interface_version = INTERFACE_VERSION  # kept current with the interface
    unsupported: frozenset[str] = frozenset()

    def __init__(self, recipe: Recipe | None = None):
        # Our trainer's default recipe: the conformance suite holds it to speculators' trainer.
        self.recipe = recipe or train_recipe()

    def default_target_layer_ids(self, num_target_layers, num_draft_layers):
        return layers.build_target_layer_ids(num_target_layers, num_draft_layers)

    def context_features(self, hidden_states, layer_ids):
        return context_features(hidden_states, layer_ids)

    def select_anchors(self, loss_mask, max_anchors, block_size, seed):
        torch.manual_seed(seed)
        return anchor_rules.select_anchors(loss_mask, max_anchors, block_size)

    def training_mask(self, document_ids, anchors, block_size, sliding_window, causal_block):
        return masks.training_mask(document_ids, anchors, block_size, sliding_window, causal_block)

    def inference_mask(self, context_len, block_len, sliding_window, causal):
        return masks.inference_mask(context_len, block_len, sliding_window, causal)

    def vocab_mapping(self, token_freq, draft_vocab_size, target_vocab_size):
        d2t = vocab_mapping.mapping_from_frequencies(token_freq, draft_vocab_size, target_vocab_size)
        return d2t, vocab_mapping.t2d_from_d2t(d2t, target_vocab_size)

    def proposed_ids(self, drafter: DFlashDrafter, hidden, target):
        return drafter.compute_logits(hidden, output_head(target)).argmax(-1)

    def build_drafter(self, spec: DraftSpec, state_dict, target: nn.Module | None = None) -> DFlashDrafter:
        return built_for(target, lambda: build_drafter(spec, state_dict)).eval()

    def project_context(self, drafter: DFlashDrafter, context_features):
        return drafter.project_context(context_features)

    @torch.no_grad()
    def apply_rotary(self, drafter: DFlashDrafter, x, position_ids):
        # looked up at call time (a planted bug replaces it)
        return impl.model.rotate(x, *drafter.rotary_emb(x, position_ids), drafter.spec.rope_style == "gptj")

    def draft_forward(self, drafter: DFlashDrafter, noise_embedding, target_hidden, position_ids):
        return drafter(noise_embedding, target_hidden, position_ids)

    def training_outputs(self, drafter: DFlashDrafter, target, input_ids, loss_mask, document_ids, max_anchors, seed,
                         anchors=None):
        # The trainer's own step, so the conformance suite checks the code that trains.
        torch.manual_seed(seed)
        # The trainer records the drafter's own slot layout (`trained_layout` refuses any other).
        recipe = self.recipe.replace(max_anchors=max_anchors, sample_from_anchor=drafter.spec.sample_from_anchor)
        step = training_step(drafter, target, input_ids, loss_mask, document_ids, recipe, with_loss=False,
                             anchors=None if anchors is None else [anchors])
        out = step.outputs
        return TrainingOutputs(anchors=out.anchors[0], anchor_valid=out.anchor_valid[0], logits=out.logits,
                               targets=out.targets, loss_mask=out.loss_mask, hidden=out.hidden, selector=out.selector,
                               family=out.family)

    def family_loss(self, drafter: DFlashDrafter, target, input_ids, loss_mask, document_ids, recipe: Recipe, seed,
                    anchors=None):
        """Every loss term of the trainer's own step on a DSpark or XPress drafter (speculators' metric names)."""
        torch.manual_seed(seed)
        step = training_step(drafter, target, input_ids, loss_mask, document_ids, recipe,
                             anchors=None if anchors is None else [anchors])
        return step.terms

    def loss_weights(self, block_size, gamma, sample_from_anchor):
        return losses.decay_weights(block_size, gamma, sample_from_anchor)

    def loss(self, logits, targets, loss_mask, block_size, gamma, loss_fn, sample_from_anchor):
        return losses.dflash_loss(logits, targets, loss_mask, block_size, gamma, loss_fn, sample_from_anchor)

    def dpace_weights(self, per_slot_loss, loss_mask, block_size, dpace_alpha):
        return losses.dpace_weights(per_slot_loss, loss_mask, block_size, dpace_alpha)

    def dpace_loss(self, logits, targets, loss_mask, block_size, dpace_alpha):
        return losses.dflash_loss(logits, targets, loss_mask, block_size, loss_fn="ce",
                                  per_position_loss_weight="dpace", dpace_alpha=dpace_alpha)

    def block_metrics(self, logits, targets, loss_mask, block_size):
        metrics = losses.block_metrics(logits, targets, loss_mask, block_size)
        return {"position_acc": metrics["position_acc"], "eal": metrics["eal"]}

    # -- slot layout -------------------------------------------------------------------------
    def speculative_tokens(self, block_size, sample_from_anchor):
        return slot_layout.speculative_tokens(block_size, sample_from_anchor)

    def proposal_logits(self, drafter: DFlashDrafter, target, input_ids):
        """The live loop's own pieces: one `decoding.draft_block` after the prompt's context, its proposing
        slots through the head."""
        start = input_ids.shape[1] - 1
        with torch.no_grad():
            states = target(input_ids[:, :start], output_hidden_states=True).hidden_states
            features = context_features(states, drafter.target_layer_ids)
            _, hidden = decoding.draft_block(drafter, target, DraftCache(drafter.spec.num_hidden_layers), features,
                                             int(input_ids[0, -1]), start, drafter.block_size)
            return drafter.compute_logits(hidden[0], output_head(target))

    # -- DFlash2 ----------------------------------------------------------------------------
    def dynamic_conv(self, drafter: DFlashDrafter, layer_idx, sublayer, x, y, block_size):
        conv = getattr(drafter.layers[layer_idx], f"{sublayer}_conv")
        prepared, delta = conv.prepare(x)
        return prepared, conv.finish(y, delta)

    def selector_path(self, drafter: DFlashDrafter, hidden, unary_logits, first_token, temperature=0.0, seed=0):
        sampler = Sampler(temperature, seed)
        path = drafter.candidate_selector.select(hidden, unary_logits, torch.tensor([first_token]),
                                                 sampler.pick_index)
        return path.tokens[0], path.candidates[0], None if path.probs is None else path.probs[0]

    def selector_scores(self, drafter: DFlashDrafter, unary_logits, hidden, predecessors, candidates):
        return drafter.candidate_selector.score_candidates(unary_logits, hidden, predecessors, candidates)

    def selector_training_candidates(self, candidate_ids, target_ids):
        return dflash2.training_candidates(candidate_ids, target_ids)

    def selector_loss(self, candidate_scores, label_positions, loss_mask, block_size, gamma, per_position_loss_weight,
                      dpace_alpha):
        return losses.selector_loss(candidate_scores, label_positions, loss_mask, block_size, gamma,
                                    per_position_loss_weight=per_position_loss_weight, dpace_alpha=dpace_alpha)

    # -- DSpark and XPress --------------------------------------------------------------------
    def markov_bias(self, drafter: DFlashDrafter, prev_ids, hidden):
        return drafter.markov_head.block_bias(prev_ids, hidden)

    def confidence_logits(self, drafter: DFlashDrafter, prev_ids, hidden):
        embedded = drafter.markov_head.embed(prev_ids) if drafter.spec.confidence_head_with_markov else None
        return drafter.confidence_head(confidence_features(hidden, embedded))

    def markov_path(self, drafter: DFlashDrafter, hidden, base_logits, anchor):
        tokens, _ = draft_left_to_right(drafter.markov_head, hidden, base_logits, torch.tensor([anchor]),
                                        drafter.spec.first_proposing_slot, lambda logits: (logits.argmax(-1), None))
        return tokens[0]

    def refiner_bias(self, drafter: DFlashDrafter, prev_ids, hidden):
        head = drafter.refiner_head
        return head.block_bias(prev_ids, head.hidden_cache(hidden))

    def jacobi_tokens(self, drafter: DFlashDrafter, hidden, base_logits, anchor, before_anchor):
        return jacobi_resolve(drafter.refiner_head, hidden, base_logits, torch.tensor([anchor]),
                              torch.tensor([before_anchor]), drafter.spec.num_jacobi_passes,
                              drafter.spec.sample_from_anchor)[0]

    def generate(self, drafter, target, input_ids, max_new_tokens, stop_token_ids, temperature=0.0,
                 seed=0) -> GenerationResult:
        result = dflash_decode(drafter, target, input_ids, max_new_tokens, stop_token_ids, temperature, seed)
        return GenerationResult(output_ids=result.output_ids, acceptance_lengths=result.acceptance_lengths)

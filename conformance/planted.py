"""Planted bugs: each known DFlash bug class reproduced in `impl/` at run time (monkeypatch or a
recipe switch, never a file edit), with the component check that must catch it.

`PlantedBug.plant(monkeypatch, ours)` applies the mutation and returns the implementation
to run the check with; `check(cmp, ours, references)` runs the bug's component check on a
fixed, small case.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

import torch

import impl.decoding
import impl.dflash2
import impl.dspark
import impl.extract
import impl.family_losses
import impl.family_step
import impl.implementation
import impl.losses
import impl.masks
import impl.model
import impl.slot_layout
import impl.train_step
import impl.xpress
from conformance.checks import (
    family_heads,
    family_losses,
    dflash2,
    draft_vocab,
    layers,
    losses,
    masks,
    rotary,
    slot_layout,
    training,
    vocab,
)
from conformance.checks.slot_layout import SlotCase
from conformance.strategies import (
    FamilyLossCase,
    HeadCase,
    ConvCase,
    DPaceCase,
    LossCase,
    MaskCase,
    RotaryCase,
    SelectorCase,
    TrainingCase,
)
from catalogue.pitfalls import PITFALLS
from impl.dflash2 import CandidateSelector
from impl.extract import HiddenStateExtractor, final_norm
from impl.model import DFlashDrafter
from impl.recipe import DEFAULTS, XPRESS_LOSS, Recipe
from impl.spec import DraftSpec
from impl.target_alignment import TargetAligner

SPEC = DraftSpec(hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                 num_hidden_layers=2, target_vocab_size=96, target_layer_ids=(0, 1, 2), num_target_layers=4,
                 mask_token_id=95, block_size=4, layer_types=("sliding_attention", "full_attention"),
                 sliding_window=5)
TRAINING = TrainingCase(spec=SPEC, lengths=(12, 9), padding=2, max_anchors=6, seed=3)
# Two documents (the second starts untrained), a prompt hole, one padded anchor; alpha far from 1/2
# so that alpha and 1 - alpha differ.
DPACE = DPaceCase(per_slot_loss=-torch.tensor([[0.9, 0.8, 0.3, 0.95, 0.9, 0.6, 0.99, 0.2, 0.5, 0.7, 0.9, 0.4,
                                                0.9, 0.9, 0.9, 0.9]]).log(),
                  loss_mask=torch.tensor([[0, 1, 1, 1, 0, 1, 0, 1, 0, 1, 1, 0, 0, 0, 0, 0]], dtype=torch.float32),
                  block_size=4, alpha=0.3)
DPACE_LOSS = LossCase(num_anchors=4, block_size=4, vocab=16, gamma=DEFAULTS["gamma"], kind="ce", sample_from_anchor=False,
                      dtype=torch.float32, seed=5)
# DFlash2: the same small drafter with 3-tap convolutions in groups of 8, a rank-8 selector over the top 5,
# bidirectional sliding windows.
DFLASH2_SPEC = dataclasses.replace(SPEC, conv_kernel_size=3, conv_group_size=8, selector_rank=8, selector_top_k=5,
                                   sliding_window_non_causal=True)
CONV = ConvCase(spec=DFLASH2_SPEC, layer=1, sublayer="mlp", num_blocks=3, seed=4)
SELECTOR = SelectorCase(spec=DFLASH2_SPEC, slots=10, first_token=7, temperature=0.0, seed=6)
DFLASH2_TRAINING = dataclasses.replace(TRAINING, spec=DFLASH2_SPEC)
# A reduced draft vocabulary of 20 of the 96 target tokens: its d2t offsets are far from zero.
DRAFT_VOCAB = dataclasses.replace(TRAINING, spec=dataclasses.replace(SPEC, draft_vocab_size=20))
# The anchor-as-bonus layout on full attention: the slot layout alone (speculators' block masks window the
# context from the anchor, decoding's from each query: a sliding layer would add that difference, #25).
FULL_ATTENTION = dataclasses.replace(SPEC, layer_types=("full_attention",) * SPEC.num_hidden_layers,
                                     sliding_window=None)
SLOT = SlotCase(spec=FULL_ATTENTION, context_len=9, seed=11)
MASK = MaskCase(document_ids=torch.tensor([[0] * 8 + [1] * 8 + [-1] * 2]), anchors=torch.tensor([0, 5, 9, 15]),
                block_size=4, sliding_window=None, causal_block=False)

# Rotary (#35): half of each head rotated (held to transformers' partial rotary), interleaved pairs (held to
# transformers' GPT-J rotary), and a linear scaling (held to z-lab's rotary), at positions well past 0.
ROTARY_SPEC = dataclasses.replace(SPEC, layer_types=("full_attention",) * SPEC.num_hidden_layers, sliding_window=None)
PARTIAL_ROTARY = RotaryCase(spec=dataclasses.replace(ROTARY_SPEC, partial_rotary_factor=0.5), length=6,
                            position_offset=9, seed=2)
INTERLEAVED_ROTARY = dataclasses.replace(PARTIAL_ROTARY, spec=dataclasses.replace(ROTARY_SPEC, rope_style="gptj"))
SCALED_ROTARY = RotaryCase(spec=dataclasses.replace(ROTARY_SPEC, rope_scaling={"rope_type": "linear", "factor": 2.0}),
                           length=6, position_offset=9, seed=2)


# DSpark (#37) and XPress (#38) on the same full-attention drafter: an rnn Markov head with a confidence head
# reading its embedding, every slot proposing; a rank-8 refiner resolved by one Jacobi pass (a second finds the
# same tokens on these weights, so a pass short shows only from one).
DSPARK_HEADS = HeadCase(spec=dataclasses.replace(FULL_ATTENTION, markov_rank=8, markov_head_type="rnn",
                                                 enable_confidence_head=True, confidence_head_with_markov=True,
                                                 sample_from_anchor=True), num_blocks=3, anchor=7, before_anchor=11,
                        seed=3)
XPRESS_HEADS = HeadCase(spec=dataclasses.replace(FULL_ATTENTION, xpress_rank=8, xpress_mlp_ratio=2, num_jacobi_passes=1),
                        num_blocks=3, anchor=7, before_anchor=11, seed=3)


# DSpark's and XPress's losses on the same drafter, anchor-as-bonus layout (slot k's previous token is then not the
# one it proposes), every term switched on.
DSPARK_LOSS = FamilyLossCase(
    TrainingCase(dataclasses.replace(DSPARK_HEADS.spec, markov_head_type="vanilla", sample_from_anchor=False),
                 (12, 9), 2, 5, 3),
    Recipe(loss_fn="kl_div", per_position_loss_weight="fixed-exp-decay", max_anchors=5, confidence_head_alpha=0.7))
XPRESS_LOSS_CASE = FamilyLossCase(
    TrainingCase(XPRESS_HEADS.spec, (12, 9), 2, 5, 3),
    Recipe(loss_fn=XPRESS_LOSS, per_position_loss_weight="fixed-exp-decay", max_anchors=5))


def _confidence_toward_tv(original):
    return lambda logits, targets: 1.0 - original(logits, targets)


def _markov_prev_is_own_token(_original):
    return lambda block_tokens, sample_from_anchor=False: block_tokens


def _rounds_summed(_original):
    return lambda rounds: torch.stack(rounds).sum()


def _before_anchor_is_anchor(_original):
    return lambda input_ids, document_ids, anchors: input_ids[anchors]


def _chain_never_advances(original):
    def draft(head, hidden, base_logits, anchor, first, pick):
        tokens, probs = [], []
        for slot in range(first, hidden.shape[1]):  # every slot follows the anchor: the picks never fed back
            slot_tokens, slot_probs = original(head, hidden[:, : slot + 1], base_logits[:, : slot + 1], anchor, slot,
                                               pick)
            tokens.append(slot_tokens[:, -1])
        return torch.stack(tokens, dim=1), None
    return draft


def _rnn_state_reset(original):
    return lambda self, embedded, hidden, state: original(self, embedded, hidden, None)


def _confidence_input_swapped(_original):
    return lambda hidden, embedded: hidden if embedded is None else torch.cat([embedded.to(hidden.dtype), hidden], -1)


def _one_pass_short(original):
    return lambda head, hidden, base, anchor, before, passes, layout: original(head, hidden, base, anchor, before,
                                                                               max(passes - 1, 0), layout)


def _anchor_as_its_own_predecessor(original):
    return lambda head, hidden, base, anchor, before, passes, layout: original(head, hidden, base, anchor, anchor,
                                                                               passes, layout)


def _mixer_unmasked(_original):
    def block_bias(self, prev_ids, hcache):
        x = self.in_proj(torch.cat([hcache, self.token_embed(prev_ids.long()).to(hcache.dtype)], dim=-1))
        size = x.shape[1]
        x = x + torch.einsum("rkj,njr->nkr", self.mix_l[:, :size, :size].to(x.dtype), x)  # later slots leak back
        return self.readout(x + self.mlp_down(torch.nn.functional.silu(self.mlp_gate(x)) * self.mlp_up(x)))
    return block_bias


def _anchor_slot_proposes(_original):
    return property(lambda spec: 0)  # every slot's logits read, the anchor's too, whatever the layout


def _every_slot_counted(_original):
    return lambda block_size, sample_from_anchor: block_size  # B speculative tokens under either layout


@dataclass(frozen=True)
class PlantedBug:
    name: str
    pitfall: int  # the catalogue entry whose check must catch it
    plant: Callable[[Any, Any], Any]  # (monkeypatch, ours) -> implementation to check
    check: Callable[[Any, Any, dict], None]  # (comparator, implementation, references)

    @property
    def component(self) -> str:
        return PITFALLS[self.pitfall].component


def _with_recipe(**changes):
    def plant(_monkeypatch, ours):
        return type(ours)(recipe=ours.recipe.replace(**changes))
    return plant


def _patch(target, name, make):
    """Replace `target.name` with `make(original)`."""
    def plant(monkeypatch, ours):
        monkeypatch.setattr(target, name, make(getattr(target, name)))
        return ours
    return plant


def _patch_imported(home, name, importers, make):
    """Replace a function that `importers` import by name from `home`: mutate it in every one of them."""
    def plant(monkeypatch, ours):
        mutated = make(getattr(home, name))
        for module in (home, *importers):
            monkeypatch.setattr(module, name, mutated)
        return ours
    return plant


def _patch_training_mask(make):
    """Our training mask lives in impl.masks and is imported by name into impl.model."""
    return _patch_imported(impl.masks, "training_mask", (impl.model,), make)


def _fc_misses_last_layer(_original):
    return property(lambda spec: (len(spec.target_layer_ids) - 1) * spec.hidden_size)


def _double_norm(original):
    def call(self, *args, **kwargs):
        states = original(self, *args, **kwargs)
        states.source = final_norm(self.target)(states.source)  # = verifier_norm(hs[-1])
        return states
    return call


def _noisy_targets(original):
    def call(self, *args, **kwargs):
        states = original(self, *args, **kwargs)
        states.source = states.source + 0.5 * torch.randn_like(states.source)
        return states
    return call


def _slot0_weighted(original):
    def weights(block_size, gamma=DEFAULTS["gamma"], sample_from_anchor=False, device=None):
        w = original(block_size, gamma, sample_from_anchor, device=device).clone()
        w[0] = 1.0
        return w
    return weights


def _sees_anchor(original):
    def mask(document_ids, anchors, block_size, sliding_window=None, causal_block=False):
        m = original(document_ids, anchors, block_size, sliding_window, causal_block)
        docs = document_ids.reshape(-1)
        rows = torch.arange(anchors.numel() * block_size)
        cols = anchors.reshape(-1).long().repeat_interleave(block_size)
        m[rows, cols] |= docs[cols] != -1  # `<=` instead of `<`: the anchor's own base token
        return m
    return mask


def _one_document(original):
    def mask(document_ids, anchors, block_size, sliding_window=None, causal_block=False):
        merged = torch.where(document_ids != -1, 0, -1)  # document boundaries ignored
        return original(merged, anchors, block_size, sliding_window, causal_block)
    return mask


def _causal_everywhere(original):
    def layer_masks(self, make):
        return original(self, lambda window, _causal: make(window, True))
    return layer_masks


def _positions_restart(original):
    def forward(self, noise_embedding, target_hidden, position_ids, masks=None, cache=None):
        context = target_hidden.shape[1]
        restarted = position_ids.clone()
        restarted[:, context:] = torch.arange(noise_embedding.shape[1]) % self.block_size
        return original(self, noise_embedding, target_hidden, restarted, masks=masks, cache=cache)
    return forward


def _other_mask_token(_original):
    return property(lambda drafter: (drafter.spec.mask_token_id + 1) % drafter.spec.target_vocab_size)


def _unsmoothed(_original):
    return lambda q, alpha: q  # the prefix product of raw confidences


def _alpha_flipped(original):
    return lambda q, alpha: original(q, 1.0 - alpha)


def _suffix_sum_forward(_original):
    return lambda x: torch.cumsum(x, dim=-1)  # sum over j <= k instead of j >= k


def _weights_in_graph(_original):
    def weights(per_slot_loss, loss_mask, block_size, alpha=0.5):
        return impl.losses.dpace_weights_of(per_slot_loss, loss_mask, block_size, alpha)  # no detach
    return weights


def _anchor_slot_trained(original):
    def weights(per_slot_loss, loss_mask, block_size, alpha=0.5):
        mask = loss_mask.clone().reshape(-1, block_size)
        mask[:, 0] = 1  # the anchor (an input, never predicted) counted as a trained slot
        return original(per_slot_loss, mask.reshape(loss_mask.shape), block_size, alpha)
    return weights


def _conv_shift_off_by_one(original):
    def conv(x, delta, base, group_size, block_size):
        # Tap t reads slot i - t - 1 (within the block): the current slot never reaches its own output.
        shifted = torch.nn.functional.pad(x[:, :-1], (0, 0, 1, 0))
        slot = torch.arange(x.shape[1]) % block_size
        return original(shifted * (slot >= 1).view(1, -1, 1).to(x.dtype), delta, base, group_size, block_size)
    return conv


def _predecessor_same_slot(_original):
    return lambda block_tokens, sample_from_anchor=False: block_tokens  # slot k's own token, not slot k - 1's


def _rerank_without_unary(original):
    def select(self, hidden, unary_logits, first_predecessor, pick):
        # The same candidates, every unary score equal: only the transition term ranks them.
        top = unary_logits.topk(self.top_k, dim=-1).indices
        flat = torch.full_like(unary_logits, float("-inf")).scatter(-1, top, 0.0)
        return original(self, hidden, flat, first_predecessor, pick)
    return select


def _d2t_as_absolute_ids(_original):
    """d2t read as the target ids themselves instead of offsets (target id = draft id + d2t[draft id])."""
    return lambda d2t: d2t.long()


def _rotate_last_dims(original):
    def rotate(x, cos, sin, interleaved=False):
        rotary_dim = cos.shape[-1]
        if rotary_dim == x.shape[-1]:
            return original(x, cos, sin, interleaved)
        return torch.cat([x[..., :-rotary_dim], original(x[..., -rotary_dim:], cos, sin, interleaved)], dim=-1)
    return rotate


def _pairs_as_halves(original):
    return lambda x, cos, sin, interleaved=False: original(x, cos, sin)  # the style dropped: rotate_half always


def _scaling_dropped(original):
    return lambda spec: original(dataclasses.replace(spec, rope_scaling=None))


def _patch_decode(make):
    """Our live loop lives in impl.decoding and is imported by name into impl.implementation."""
    return _patch_imported(impl.decoding, "dflash_decode", (impl.implementation,), make)


def _mask_ids_dropped(original):
    def decode(drafter, target, input_ids, *args, **kwargs):
        result = original(drafter, target, input_ids, *args, **kwargs)
        # The output buffer's unwritten slots hold the mask id; trimming "them" also drops real tokens of that id.
        new = result.output_ids[:, result.num_prompt_tokens:]
        kept = torch.cat([result.output_ids[:, :result.num_prompt_tokens], new[new != drafter.mask_token_id][None]], 1)
        return dataclasses.replace(result, output_ids=kept)
    return decode


def _head_sized_to_tokenizer(original):
    def logits(self, hidden, head):
        return original(self, hidden, head)[..., :vocab.TOKENIZER_LENGTH]  # the padding rows cut off
    return logits


def _set(value):
    return lambda _original: value


BUGS = [
    PlantedBug("fc fed n-1 layers", 4, _patch(DraftSpec, "fc_in_features", _fc_misses_last_layer),
               lambda cmp, ours, refs: layers.fc_dims(cmp, ours, refs["zlab"], (SPEC, torch.float32))),
    PlantedBug("hs[id] instead of hs[id+1]", 2,
               _patch(impl.extract, "hidden_state_index", _set(lambda layer_id: layer_id)),
               lambda cmp, ours, refs: layers.context_feature_indexing(cmp, ours, refs["zlab"], (4, 32, [0, 2]))),
    PlantedBug("targets from an intermediate layer", 3,
               _with_recipe(verifier_source_layer=SPEC.num_target_layers - 2),
               lambda cmp, ours, refs: training.targets_source(cmp, ours, refs["speculators"], TRAINING)),
    PlantedBug("double-normalised targets", 3, _patch(HiddenStateExtractor, "__call__", _double_norm),
               lambda cmp, ours, refs: training.targets_source(cmp, ours, refs["speculators"], TRAINING)),
    PlantedBug("gamma 7", 6, _with_recipe(gamma=7.0),
               lambda cmp, ours, refs: losses.recipe_defaults(cmp, ours, ("gamma",))),
    PlantedBug("weight on slot 0", 6, _patch(impl.losses, "decay_weights", _slot0_weighted),
               lambda cmp, ours, refs: losses.loss_weights(cmp, ours, refs["speculators"], (8, 4.0, False))),
    PlantedBug("D-PACE prefix product without smoothing", 18,
               _patch(impl.losses, "smoothed_confidence", _unsmoothed),
               lambda cmp, ours, refs: losses.dpace_weights(cmp, ours, refs["speculators"], DPACE)),
    PlantedBug("D-PACE suffix sum run forward", 18,
               _patch(impl.losses, "suffix_sum", _suffix_sum_forward),
               lambda cmp, ours, refs: losses.dpace_weights(cmp, ours, refs["speculators"], DPACE)),
    PlantedBug("D-PACE weights not detached", 18,
               _patch(impl.losses, "dpace_weights", _weights_in_graph),
               lambda cmp, ours, refs: losses.dpace_loss(cmp, ours, refs["speculators"], DPACE_LOSS, DPACE.alpha)),
    PlantedBug("D-PACE alpha read as 1 - alpha", 18,
               _patch(impl.losses, "smoothed_confidence", _alpha_flipped),
               lambda cmp, ours, refs: losses.dpace_weights(cmp, ours, refs["speculators"], DPACE)),
    PlantedBug("D-PACE anchor slot weighted", 18,
               _patch(impl.losses, "dpace_weights", _anchor_slot_trained),
               lambda cmp, ours, refs: losses.dpace_weights(cmp, ours, refs["speculators"], DPACE)),
    PlantedBug("wrong roll", 5, _patch(TargetAligner, "shift", _set(0)),
               lambda cmp, ours, refs: training.target_alignment(cmp, ours, refs["speculators"], TRAINING)),
    PlantedBug("<= in the mask", 9, _patch_training_mask(_sees_anchor),
               lambda cmp, ours, refs: masks.training_mask(cmp, ours, refs["speculators"], MASK)),
    PlantedBug("cross-document attention", 9, _patch_training_mask(_one_document),
               lambda cmp, ours, refs: masks.training_mask(cmp, ours, refs["speculators"], MASK)),
    PlantedBug("causal full-attention blocks", 9,
               _patch(DFlashDrafter, "layer_masks", _causal_everywhere),
               lambda cmp, ours, refs: training.training_forward(cmp, ours, refs["speculators"], TRAINING)),
    PlantedBug("positions restarting per block", 12, _patch(DFlashDrafter, "forward", _positions_restart),
               lambda cmp, ours, refs: training.training_forward(cmp, ours, refs["speculators"], TRAINING)),
    PlantedBug("noise leaking into targets", 15, _patch(HiddenStateExtractor, "__call__", _noisy_targets),
               lambda cmp, ours, refs: training.noise_stays_out_of_targets(cmp, ours, refs["speculators"], TRAINING)),
    PlantedBug("conv causal shift off by one", 22, _patch(impl.dflash2, "grouped_dynamic_conv", _conv_shift_off_by_one),
               lambda cmp, ours, refs: dflash2.conv_taps(cmp, ours, refs["speculators"], CONV)),
    PlantedBug("selector predecessor from the wrong slot", 24,
               _patch(impl.train_step, "teacher_forced_predecessors", _predecessor_same_slot),
               lambda cmp, ours, refs: dflash2.selector_training(cmp, ours, refs["speculators"], DFLASH2_TRAINING)),
    PlantedBug("top-k reranked without the unary term", 23, _patch(CandidateSelector, "select", _rerank_without_unary),
               lambda cmp, ours, refs: dflash2.selector_path(cmp, ours, refs["zlab"], SELECTOR)),
    PlantedBug("d2t applied as absolute ids, not offsets", 32, _patch(impl.model, "target_ids", _d2t_as_absolute_ids),
               lambda cmp, ours, refs: draft_vocab.proposals(cmp, ours, refs["speculators"], DRAFT_VOCAB)),
    PlantedBug("decoding reads the anchor slot's logits (anchor-as-bonus layout)", 33,
               _patch(DraftSpec, "first_proposing_slot", _anchor_slot_proposes),
               lambda cmp, ours, refs: slot_layout.proposals(cmp, ours, refs["speculators"], SLOT)),
    PlantedBug("B speculative tokens under the anchor-as-bonus layout", 33,
               _patch(impl.slot_layout, "speculative_tokens", _every_slot_counted),
               lambda cmp, ours, refs: slot_layout.speculative_tokens(cmp, ours, refs["speculators"], 8, False)),
    PlantedBug("partial rotary on the last dims", 35, _patch(impl.model, "rotate", _rotate_last_dims),
               lambda cmp, ours, refs: rotary.against_transformers(cmp, ours, PARTIAL_ROTARY)),
    PlantedBug("interleaved rotary rotated as halves", 35, _patch(impl.model, "rotate", _pairs_as_halves),
               lambda cmp, ours, refs: rotary.against_transformers(cmp, ours, INTERLEAVED_ROTARY)),
    PlantedBug("rope scaling dropped", 35, _patch(impl.model, "DraftRotaryEmbedding", _scaling_dropped),
               lambda cmp, ours, refs: rotary.rotary(cmp, ours, refs["zlab"], SCALED_ROTARY)),
    PlantedBug("mask token mismatch", 14, _patch(DFlashDrafter, "mask_token_id", _other_mask_token),
               lambda cmp, ours, refs: training.training_forward(cmp, ours, refs["speculators"], TRAINING)),
    PlantedBug("generated mask-id tokens dropped from the output", 34, _patch_decode(_mask_ids_dropped),
               lambda cmp, ours, refs: vocab.mask_token_kept(cmp, ours, refs["zlab"], vocab.mask_kept_case())),
    PlantedBug("draft head sized to the tokenizer, not the padded vocabulary", 36,
               _patch(DFlashDrafter, "draft_logits", _head_sized_to_tokenizer),
               lambda cmp, ours, refs: vocab.padded_vocabulary(cmp, ours, refs["speculators"])),
    PlantedBug("Markov chain never fed its own picks (every slot follows the anchor)", 37,
               _patch_imported(impl.dspark, "draft_left_to_right", (impl.decoding, impl.implementation),
                               _chain_never_advances),
               lambda cmp, ours, refs: family_heads.decoding_round(cmp, ours, refs["speculators"], DSPARK_HEADS,
                                                                   "markov_path")),
    PlantedBug("rnn Markov state reset at every slot", 37, _patch(impl.dspark.MarkovHead, "step", _rnn_state_reset),
               lambda cmp, ours, refs: family_heads.head_forward(cmp, ours, refs["speculators"], DSPARK_HEADS,
                                                                 ("markov_bias",))),
    PlantedBug("confidence input as [markov embedding ; hidden]", 37,
               _patch_imported(impl.dspark, "confidence_features", (impl.implementation,), _confidence_input_swapped),
               lambda cmp, ours, refs: family_heads.head_forward(cmp, ours, refs["speculators"], DSPARK_HEADS,
                                                                 ("confidence_logits",))),
    PlantedBug("confidence head trained toward TV instead of the acceptance rate 1 - TV", 37,
               _patch(impl.family_losses, "acceptance_rate", _confidence_toward_tv),
               lambda cmp, ours, refs: family_losses.loss_terms(cmp, ours, refs["speculators"], DSPARK_LOSS)),
    PlantedBug("Markov bias in training fed the token the slot proposes", 37,
               _patch(impl.family_step, "teacher_forced_predecessors", _markov_prev_is_own_token),
               lambda cmp, ours, refs: family_losses.loss_terms(cmp, ours, refs["speculators"], DSPARK_LOSS)),
    PlantedBug("consistency rounds' losses summed, not averaged", 38,
               _patch(impl.family_losses, "consistency_loss", _rounds_summed),
               lambda cmp, ours, refs: family_losses.loss_terms(cmp, ours, refs["speculators"], XPRESS_LOSS_CASE)),
    PlantedBug("teacher-forced slot 0 follows the anchor itself in training", 38,
               _patch_imported(impl.family_step, "token_before_anchor", (impl.train_step,), _before_anchor_is_anchor),
               lambda cmp, ours, refs: family_losses.loss_terms(cmp, ours, refs["speculators"], XPRESS_LOSS_CASE)),
    PlantedBug("refiner mixer not masked to its lower triangle", 38,
               _patch(impl.xpress.RefinerHead, "block_bias", _mixer_unmasked),
               lambda cmp, ours, refs: family_heads.head_forward(cmp, ours, refs["speculators"], XPRESS_HEADS,
                                                                 ("refiner_bias",))),
    PlantedBug("one Jacobi pass short", 38,
               _patch_imported(impl.xpress, "jacobi_resolve", (impl.decoding, impl.implementation), _one_pass_short),
               lambda cmp, ours, refs: family_heads.decoding_round(cmp, ours, refs["speculators"], XPRESS_HEADS,
                                                                   "jacobi_tokens")),
    PlantedBug("slot 0 follows the anchor itself, not the token before it (vLLM 0.33.0's stand-in)", 38,
               _patch_imported(impl.xpress, "jacobi_resolve", (impl.decoding, impl.implementation),
                               _anchor_as_its_own_predecessor),
               lambda cmp, ours, refs: family_heads.decoding_round(cmp, ours, refs["speculators"], XPRESS_HEADS,
                                                                   "jacobi_tokens")),
]

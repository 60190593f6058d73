"""SpecForge 0.2.0 (SGLang's speculative-decoding trainer) behind `impl/interface.py`, held to the references.

Every operation calls SpecForge's own DFlash code: `specforge/modeling/draft/dflash.py` (the drafter,
`build_target_layer_ids`, `extract_context_feature`, `spec_generate`) and
`specforge/algorithms/common/dflash_family_model.py` (`OnlineDFlashModel`: anchors, training masks,
the training forward, the DFlash and D-PACE objectives). The glue here only translates the
interface: shapes, and the one division SpecForge's `forward` does after its objective terms.

Set up as SpecForge's trainer sets up a CPU run: `attention_backend="eager"` for both the drafter's
attention and the mask builder (anything but flex attention builds its dense boolean masks), the
objective's defaults read from SpecForge's own `TrainingConfig`.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from types import SimpleNamespace
from unittest import mock

import torch
from torch import nn

from foundation.packages import PINNED, installed_version
from impl.interface import GenerationResult, TrainingOutputs, Unsupported
from foundation.param_names import strip_wrapper_prefixes
from impl.spec import DraftSpec
from drafter_files.zlab_format import zlab_config

VERSION = PINNED["specforge"]
if installed_version("specforge") != VERSION:
    raise ImportError(f"held.specforge wraps specforge {VERSION}; installed: "
                      f"{installed_version('specforge') or 'none'} (make setup pins it)")

import specforge.modeling.draft.dflash as sf_draft  # noqa: E402  (after the version guard on purpose)
from specforge.algorithms.common.dflash_family_model import (  # noqa: E402
    OnlineDFlashModel,
    create_dflash_sdpa_mask,
)
from specforge.config.schema import TrainingConfig  # noqa: E402

ATTENTION = "eager"  # SpecForge's `training.attention_backend` for a CPU run


@dataclass(frozen=True)
class SpecForgeRecipe:
    """SpecForge's default DFlash objective (`TrainingConfig` defaults), in speculators' vocabulary."""

    loss_fn: str
    per_position_loss_weight: str
    dpace_alpha: float
    gamma: float | None
    max_anchors: int
    sample_from_anchor: bool = False


def default_recipe() -> SpecForgeRecipe:
    fields = TrainingConfig.model_fields
    loss_type, gamma = fields["loss_type"].default, fields["loss_decay_gamma"].default
    # loss_type "dflash": CE on the data's tokens, weighted by exp decay only when a gamma is set.
    weighting = "dpace" if loss_type.startswith("dpace") else ("fixed-exp-decay" if gamma else "uniform")
    return SpecForgeRecipe(loss_fn="ce", per_position_loss_weight=weighting, dpace_alpha=fields["dpace_alpha"].default,
                           gamma=gamma, max_anchors=fields["num_anchors"].default)


def objective(block_size: int, *, gamma: float | None = None, loss_type: str = "dflash",
              dpace_alpha: float | None = None, num_anchors: int | None = None, draft_model: nn.Module | None = None, lm_head: nn.Module | None = None,
              embed_tokens: nn.Module | None = None, mask_token_id: int = 0) -> OnlineDFlashModel:
    """SpecForge's `OnlineDFlashModel`; with no drafter, its objective alone runs on logits (identity head). Alpha
    and the anchor count not given are SpecForge's own defaults (its TrainingConfig)."""
    fields = TrainingConfig.model_fields
    dpace_alpha = fields["dpace_alpha"].default if dpace_alpha is None else dpace_alpha
    num_anchors = fields["num_anchors"].default if num_anchors is None else num_anchors
    return OnlineDFlashModel(draft_model=draft_model, target_lm_head=lm_head or nn.Identity(),
                             target_embed_tokens=embed_tokens or nn.Identity(), mask_token_id=mask_token_id,
                             block_size=block_size, attention_backend=ATTENTION, num_anchors=num_anchors,
                             loss_decay_gamma=gamma, loss_type=loss_type, dpace_alpha=dpace_alpha)


def _blocks(flat: torch.Tensor, block_size: int) -> torch.Tensor:
    """[1, A*B, ...] -> [1, A, B, ...], SpecForge's objective layout."""
    return flat.reshape(1, flat.shape[1] // block_size, block_size, *flat.shape[2:])


def _trained_slots(block_size: int) -> torch.Tensor:
    """SpecForge's forward excludes the anchor slot from the weight mask (`pos_in_block > 0`)."""
    return (torch.arange(block_size) > 0).float().view(1, 1, -1)


def _padded(anchors: torch.Tensor, keep: torch.Tensor, max_anchors: int) -> tuple[torch.Tensor, torch.Tensor]:
    """SpecForge draws only min(num_anchors, eligible) blocks; the interface has max_anchors slots, the rest invalid."""
    pad = max_anchors - anchors.shape[-1]
    return (torch.nn.functional.pad(anchors.reshape(-1), (0, pad)),
            torch.nn.functional.pad(keep.reshape(-1), (0, pad), value=False))


@contextmanager
def recorded_caches():
    """`spec_generate` keeps its acceptance lengths local; the target cache's crops (one per round, to the new
    length) record them. The first `DynamicCache` it makes is the target's."""
    made = []

    class RecordingCache(sf_draft.DynamicCache):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.crops = []
            made.append(self)

        def crop(self, max_length):
            # SpecForge passes the length to keep, which transformers read a positive `crop` as until 5.23; 5.24
            # refuses one. It is cropped by the count to drop instead, which every release takes: the same cut.
            self.crops.append(int(max_length))
            extra = self.get_seq_length() - max_length
            if extra > 0:
                super().crop(-extra)

    with mock.patch.object(sf_draft, "DynamicCache", RecordingCache):
        yield made


NOT_WRAPPED_DSPARK = ("specforge: SpecForge 0.2.0's DSpark (specforge/modeling/draft/dspark.py: DSparkDraftModel) is "
                      "not wrapped by this plug, which holds its DFlash only")


def _dspark_not_wrapped(self, *args, **kwargs):
    raise Unsupported(NOT_WRAPPED_DSPARK)


class SpecForgeImplementation:
    name = "specforge"
    interface_version = 10  # impl/interface_versions.py
    # No inference mask: spec_generate calls the drafter with attention_mask=None (is_causal=False).
    # No block metrics: the DFlash objective reports one overall accuracy, no per-position accuracy or EAL.
    # No XPress (refiner_bias, jacobi_tokens): SpecForge 0.2.0 has none. Its DSpark
    # (specforge/modeling/draft/dspark.py) is not wrapped here: the DSpark operations answer n/a saying so.
    unsupported: frozenset[str] = frozenset({"inference_mask", "block_metrics", "refiner_bias", "jacobi_tokens"})

    def __init__(self):
        self.recipe = default_recipe()

    def default_target_layer_ids(self, num_target_layers, num_draft_layers):
        return list(sf_draft.build_target_layer_ids(num_target_layers, num_draft_layers))

    def context_features(self, hidden_states, layer_ids):
        return sf_draft.extract_context_feature(hidden_states, layer_ids)

    def select_anchors(self, loss_mask, max_anchors, block_size, seed):
        # `_sample_anchor_positions` reads only `num_anchors` from its model; block_size plays no part in it.
        torch.manual_seed(seed)
        anchors, keep = OnlineDFlashModel._sample_anchor_positions(
            SimpleNamespace(num_anchors=max_anchors), loss_mask.shape[1], loss_mask, loss_mask.device)
        return _padded(anchors, keep, max_anchors)

    def training_mask(self, document_ids, anchors, block_size, sliding_window, causal_block):
        if sliding_window is None and causal_block:
            raise Unsupported("SpecForge: full-attention blocks are always bidirectional")
        if sliding_window is not None and not causal_block:
            raise Unsupported("SpecForge: sliding-window blocks are always causal")
        # SpecForge takes no document ids: it has no packing of several documents into one row.
        mask = create_dflash_sdpa_mask(anchors.reshape(1, -1), torch.ones(1, anchors.numel(), dtype=torch.bool),
                                       document_ids.shape[-1], block_size, document_ids.device, sliding_window)
        return mask[0, 0]

    def inference_mask(self, context_len, block_len, sliding_window, causal):
        raise Unsupported("SpecForge builds no inference mask: spec_generate passes attention_mask=None")

    def build_drafter(self, spec: DraftSpec, state_dict, target: nn.Module | None = None) -> sf_draft.DFlashDraftModel:
        from transformers import Qwen3Config

        if spec.family == "dspark":
            raise Unsupported(NOT_WRAPPED_DSPARK)
        if spec.family != "dflash":
            # SpecForge 0.2.0's other drafters (modeling/draft/) are not held here.
            raise Unsupported(f"specforge: this plug holds SpecForge 0.2.0's DFlash drafter only, not {spec.family}")
        if spec.sliding_window_non_causal and "sliding_attention" in spec.layer_types:
            raise Unsupported("specforge: SpecForge 0.2.0 has no sliding_window_non_causal setting (its training "
                              "mask keeps sliding blocks causal)")
        if spec.sample_from_anchor:
            raise Unsupported("specforge: SpecForge 0.2.0's DFlash objective has no sample-from-anchor layout")
        if spec.draft_vocab_size is not None:
            raise Unsupported("specforge: SpecForge 0.2.0's DFlash drafter has no reduced draft vocabulary (its head "
                              "is the target's lm_head)")

        config = Qwen3Config(**zlab_config(spec))
        config._attn_implementation = ATTENTION
        model = sf_draft.DFlashDraftModel(config)
        model.load_state_dict(strip_wrapper_prefixes(state_dict), strict=True)
        return model.float().eval()

    def project_context(self, drafter, context_features):
        return drafter.hidden_norm(drafter.fc(context_features))

    @torch.no_grad()
    def draft_forward(self, drafter, noise_embedding, target_hidden, position_ids):
        # As spec_generate calls it (no cache here): no mask, is_causal=False.
        return drafter(position_ids=position_ids, noise_embedding=noise_embedding, target_hidden=target_hidden,
                       is_causal=False)

    def training_outputs(self, drafter, target, input_ids, loss_mask, document_ids, max_anchors, seed, anchors=None):
        """`OnlineDFlashModel.forward` on the target's context features; its objective's inputs captured."""
        model = objective(drafter.block_size, gamma=self.recipe.gamma, num_anchors=max_anchors, draft_model=drafter,
                          lm_head=target.lm_head, embed_tokens=target.get_input_embeddings(),
                          mask_token_id=drafter.mask_token_id)
        with torch.no_grad():
            states = target(input_ids, output_hidden_states=True).hidden_states
        context = sf_draft.extract_context_feature(states, drafter.target_layer_ids)
        captured, terms = {}, model._dflash_objective_chunk_terms
        draw = model._sample_anchor_positions

        def sample(*args, **kwargs):
            captured["anchors"] = (anchors[0].reshape(1, -1), anchors[1].reshape(1, -1).bool()) \
                if anchors is not None else draw(*args, **kwargs)
            return captured["anchors"]

        def objective_terms(hidden, target_ids, weight_mask):
            captured.setdefault("chunks", []).append((hidden, target_ids, weight_mask))
            return terms(hidden, target_ids, weight_mask)

        torch.manual_seed(seed)
        with torch.no_grad(), mock.patch.object(model, "_sample_anchor_positions", sample), \
                mock.patch.object(model, "_dflash_objective_chunk_terms", objective_terms):
            model(input_ids=input_ids, hidden_states=context, loss_mask=loss_mask.float())
        hidden, target_ids, weight_mask = (torch.cat(parts, dim=1) for parts in zip(*captured["chunks"]))
        hidden = hidden.reshape(1, -1, hidden.shape[-1])
        block_anchors, keep = _padded(*captured["anchors"], max_anchors)
        slots = max_anchors * drafter.block_size
        return TrainingOutputs(
            anchors=block_anchors, anchor_valid=keep, logits=target.lm_head(hidden), targets=None,
            target_ids=target_ids.reshape(1, -1),
            loss_mask=torch.nn.functional.pad(weight_mask.reshape(1, -1), (0, slots - weight_mask.numel())),
            hidden=hidden,
            unsupported={"targets": "SpecForge trains on the data's next tokens (hard labels), not verifier logits"})

    def loss_weights(self, block_size, gamma, sample_from_anchor):
        """Per-slot weight = the objective's denominator for a weight mask holding that slot alone."""
        if sample_from_anchor:
            raise Unsupported("SpecForge's DFlash objective has no sample-from-anchor variant")
        terms = objective(block_size, gamma=gamma)._dflash_objective_chunk_terms
        weights = []
        for slot in range(block_size):
            only = torch.nn.functional.one_hot(torch.tensor(slot), block_size).float().view(1, 1, -1)
            _, den, _, _ = terms(torch.zeros(1, 1, block_size, 2), torch.zeros(1, 1, block_size, dtype=torch.long),
                                 only * _trained_slots(block_size))
            weights.append(den)
        return torch.stack(weights)

    def _objective_loss(self, model, logits, targets, loss_mask, block_size):
        """`forward`'s final division of the objective's terms: Σ(w·m·CE) / Σ(w·m) for dflash, / batch for D-PACE."""
        num, den, _, _ = model._dflash_objective_chunk_terms(
            _blocks(logits, block_size), _blocks(targets.argmax(-1), block_size),
            _blocks(loss_mask.float(), block_size) * _trained_slots(block_size))
        return num / (den if model.loss_type == "dflash" else num.new_tensor(1.0))

    def loss(self, logits, targets, loss_mask, block_size, gamma, loss_fn, sample_from_anchor):
        if loss_fn != "ce":
            raise Unsupported(f"SpecForge's DFlash objective is CE on hard labels only (no {loss_fn})")
        if sample_from_anchor:
            raise Unsupported("SpecForge's DFlash objective has no sample-from-anchor variant")
        # Hard labels from the target logits, as speculators' CE takes them (their argmax).
        return self._objective_loss(objective(block_size, gamma=gamma), logits, targets, loss_mask, block_size)

    def dpace_weights(self, per_slot_loss, loss_mask, block_size, dpace_alpha):
        mask = _blocks(loss_mask.float(), block_size)
        weights = objective(block_size, loss_type="dpace", dpace_alpha=dpace_alpha)._dpace_weight(
            torch.exp(-_blocks(per_slot_loss, block_size)), mask, mask > 0, "dpace")
        return (weights * mask).reshape(loss_mask.shape)  # the objective weighs each slot by mask * weight

    def dpace_loss(self, logits, targets, loss_mask, block_size, dpace_alpha):
        model = objective(block_size, loss_type="dpace", dpace_alpha=dpace_alpha)
        return self._objective_loss(model, logits, targets, loss_mask, block_size)

    def block_metrics(self, logits, targets, loss_mask, block_size):
        raise Unsupported("SpecForge's DFlash objective reports one overall accuracy, no per-position accuracy or EAL")

    markov_bias = confidence_logits = markov_path = _dspark_not_wrapped

    def generate(self, drafter, target, input_ids, max_new_tokens, stop_token_ids, temperature=0.0,
                 seed=0) -> GenerationResult:
        """`DFlashDraftModel.spec_generate`; rounds read from its target cache (the prefill token excluded)."""
        if temperature > 0:
            torch.manual_seed(seed)
        with recorded_caches() as caches:
            output_ids = drafter.spec_generate(target, input_ids, max_new_tokens, stop_token_ids, temperature)
        ends = [input_ids.shape[1], *caches[0].crops]
        return GenerationResult(output_ids=output_ids, acceptance_lengths=[b - a for a, b in zip(ends, ends[1:])])

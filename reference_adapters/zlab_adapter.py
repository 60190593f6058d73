"""z-lab `dflash` behind the shared interface: its model, layer rules, inference mask and live loop.

Every operation calls `dflash.model` (0.1.0, private helpers included). z-lab ships no
training code, so the training operations are declared unsupported.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from pathlib import Path
from unittest import mock

import torch
from torch import nn

from foundation.errors import CheckpointError
from foundation.placement import built_for
from foundation.transformers_compat import from_pretrained
from impl.families import config_family
from impl.interface import INTERFACE_VERSION, GenerationResult, Unsupported
from foundation.param_names import codebook_module_name, strip_wrapper_prefixes
from impl.spec import DraftSpec
from drafter_files.zlab_format import zlab_config
from reference_adapters.version_guard import check_reference, refuse_rotary

check_reference("dflash")

import dflash.model as zlab  # noqa: E402  (after the version guard on purpose)

# A reduced draft vocabulary (#32): z-lab's DFlashDraftModel has no head of its own and no d2t.
DRAFT_VOCAB_OPERATIONS = frozenset({"vocab_mapping", "proposed_ids"})
TRAINING_OPERATIONS = ("select_anchors", "training_mask", "training_outputs", "loss_weights", "loss", "block_metrics",
                       "dpace_weights", "dpace_loss", "selector_scores", "selector_training_candidates",
                       "selector_loss")


@contextmanager
def cpu_timer():
    """z-lab's `_cuda_time` calls `torch.cuda.synchronize`; on CPU a plain clock is the same measurement."""
    with mock.patch.object(zlab, "_cuda_time", time.perf_counter):
        yield


def zlab_generate(model: zlab.DFlashDraftModel, target: nn.Module, input_ids: torch.Tensor, max_new_tokens: int,
                  stop_token_ids: list[int] | None, temperature: float = 0.0):
    """z-lab's own `dflash_generate(..., return_stats=True)`, runnable on CPU."""
    with cpu_timer():
        return zlab.dflash_generate(model, target, input_ids, max_new_tokens, stop_token_ids,
                                    temperature=temperature, return_stats=True)


def zlab_twin(drafter: nn.Module) -> zlab.DFlashDraftModel:
    """z-lab's own DFlashDraftModel (or DFlash2DraftModel) carrying exactly our drafter's weights."""
    return ZlabImplementation().build_drafter(drafter.spec, drafter.state_dict())


def model_class(family: str) -> type[zlab.DFlashDraftModel]:
    return zlab.DFlash2DraftModel if family == "dflash2" else zlab.DFlashDraftModel


def in_memory_names(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """On-disk names -> z-lab's module names: its selector codebooks are Embeddings (`.weight`), which
    `DFlash2DraftModel.from_pretrained` maps the files' bare names onto."""
    return {codebook_module_name(name): tensor for name, tensor in state_dict.items()}


def load_zlab_model(path: str | Path) -> zlab.DFlashDraftModel:
    """A z-lab directory through z-lab's own `from_pretrained` (fp32, eval), DFlash or DFlash2 by its architecture."""
    import json

    try:
        family = config_family(json.loads((Path(path) / "config.json").read_text()))
        model = from_pretrained(model_class(family), str(path), dtype=torch.float32)
    except (OSError, ValueError, KeyError) as exc:
        reason = " ".join(str(exc).split())[:200]
        raise CheckpointError(f"{path}: z-lab's DFlashDraftModel cannot load it ({reason})") from exc
    return model.eval()


class ZlabImplementation:
    name = "zlab"
    interface_version = INTERFACE_VERSION  # kept current with the interface
    # No training code, and no slot-layout setting (n/a, not a failure): see `_no_slot_layout`; no draft vocabulary.
    unsupported: frozenset[str] = (frozenset(TRAINING_OPERATIONS + ("speculative_tokens", "proposal_logits"))
                                   | DRAFT_VOCAB_OPERATIONS)

    def default_target_layer_ids(self, num_target_layers, num_draft_layers):
        return list(zlab.build_target_layer_ids(num_target_layers, num_draft_layers))

    def context_features(self, hidden_states, layer_ids):
        return zlab.extract_context_feature(hidden_states, layer_ids)

    def inference_mask(self, context_len, block_len, sliding_window, causal):
        # `_attention_mask` only reads the sequence lengths of its query and key.
        query = torch.empty(1, 1, block_len, 1)
        key = torch.empty(1, 1, context_len + block_len, 1)
        return zlab._attention_mask(query, key, is_causal=causal, sliding_window=sliding_window)[0, 0]

    def build_drafter(self, spec: DraftSpec, state_dict, target: nn.Module | None = None) -> zlab.DFlashDraftModel:
        from transformers import Qwen3Config

        if spec.sample_from_anchor:
            raise Unsupported("zlab: dflash 0.1.0 has one slot layout, the anchor as the bonus token "
                              "(`dflash_generate` proposes from slots 1..B-1); no sample_from_anchor")

        refuse_rotary(spec, "zlab: dflash 0.1.0", "model.py",
                      " (a scaled rope's narrower cos/sin does not fit the head)")
        # Made where and in what dtype the target runs, as `from_pretrained(dtype=...)` makes it.
        model = built_for(target, lambda: model_class(spec.family)(Qwen3Config(**zlab_config(spec))))
        model.load_state_dict(in_memory_names(strip_wrapper_prefixes(state_dict)), strict=True)
        return model.eval()

    def project_context(self, drafter, context_features):
        return drafter.hidden_norm(drafter.fc(context_features))

    @torch.no_grad()
    def apply_rotary(self, drafter, x, position_ids):
        """z-lab's own rotary (`rotary_emb`, then model.py's `apply_rotary_pos_emb` as its keys get it)."""
        cos, sin = drafter.rotary_emb(x, position_ids)
        return zlab.apply_rotary_pos_emb(x, x, cos, sin)[1]

    @torch.no_grad()
    def draft_forward(self, drafter, noise_embedding, target_hidden, position_ids):
        # No mask passed: each z-lab layer builds its own (`_attention_mask`) as in its loop.
        return drafter(position_ids=position_ids, noise_embedding=noise_embedding, target_hidden=target_hidden)

    def generate(self, drafter, target, input_ids, max_new_tokens, stop_token_ids, temperature=0.0,
                 seed=0) -> GenerationResult:
        """z-lab's `dflash_generate`. Rounds exclude the first token, which the target's prefill emits.
        Sampling draws from the global generator, seeded here (greedy decoding leaves it alone)."""
        if temperature > 0:
            torch.manual_seed(seed)
        stats = zlab_generate(drafter, target, input_ids, max_new_tokens, stop_token_ids, temperature)
        return GenerationResult(
            output_ids=stats.output_ids, acceptance_lengths=[int(n) for n in stats.acceptance_lengths],
            extra={"num_input_tokens": stats.num_input_tokens, "num_output_tokens": stats.num_output_tokens,
                   "prefill_tokens": 1, "time_to_first_token": stats.time_to_first_token,
                   "time_per_output_token": stats.time_per_output_token})

    # -- slot layout -------------------------------------------------------------------------
    def _no_slot_layout(self, *_args, **_kwargs):
        raise Unsupported("zlab: dflash 0.1.0 has no slot-layout setting: `dflash_generate` always drafts "
                          "`[bonus, mask x (B-1)]` and proposes from slots 1..B-1 (no sample_from_anchor)")

    speculative_tokens = proposal_logits = _no_slot_layout

    # -- DFlash2 ----------------------------------------------------------------------------
    def dynamic_conv(self, drafter, layer_idx, sublayer, x, y, block_size):
        """z-lab convolves one block at a time (its forward only ever sees one): the blocks go in as rows."""
        conv = getattr(drafter.layers[layer_idx], f"{sublayer}_conv")
        rows = lambda t: t.reshape(-1, block_size, t.shape[-1])  # noqa: E731
        prepared, delta = conv.prepare(rows(x))
        return prepared.reshape(x.shape), conv.finish(rows(y), delta).reshape(y.shape)

    def selector_path(self, drafter, hidden, unary_logits, first_token, temperature=0.0, seed=0):
        """`CandidateSelector.select` as `DFlash2DraftModel.propose` calls it; draws from the global generator."""
        if temperature > 0:
            torch.manual_seed(seed)
        path, candidates, probs = drafter.candidate_selector.select(
            hidden, unary_logits, torch.tensor([first_token]), temperature)
        return path[0], candidates[0], None if probs is None else probs[0]

    def _no_selector_training(self, *_args, **_kwargs):
        raise Unsupported("zlab: dflash 0.1.0 ships no training code, hence no selector loss or its candidates")

    selector_scores = selector_training_candidates = selector_loss = _no_selector_training

    def _unsupported(self, *_args, **_kwargs):
        raise Unsupported("zlab: dflash 0.1.0 ships no training code (anchors, training mask, loss, metrics)")

    def _no_draft_vocab(self, *_args, **_kwargs):
        raise Unsupported("zlab: dflash 0.1.0 has no draft vocabulary: its drafter proposes through the target's "
                          "whole head (vLLM reads a d2t from a z-lab directory; z-lab's own code does not)")

    vocab_mapping = proposed_ids = _no_draft_vocab
    select_anchors = training_mask = training_outputs = loss_weights = loss = block_metrics = _unsupported
    dpace_weights = dpace_loss = _unsupported

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

from impl.checkpoint import CheckpointError, strip_wrapper_prefixes, zlab_config
from impl.interface import GenerationResult, Unsupported
from impl.spec import DraftSpec
from reference_adapters.versions import check_reference

check_reference("dflash")

import dflash.model as zlab  # noqa: E402  (after the version guard on purpose)

TRAINING_OPERATIONS = ("select_anchors", "training_mask", "training_outputs", "loss_weights", "loss", "block_metrics",
                       "dpace_weights", "dpace_loss")


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
    """z-lab's own DFlashDraftModel carrying exactly our drafter's (`impl.model.DFlashDrafter`) weights."""
    return ZlabImplementation().build_drafter(drafter.spec, drafter.state_dict())


def load_zlab_model(path: str | Path) -> zlab.DFlashDraftModel:
    """A z-lab directory through z-lab's own `from_pretrained` (fp32, eval)."""
    try:
        model = zlab.DFlashDraftModel.from_pretrained(str(path), dtype=torch.float32)
    except (OSError, ValueError, KeyError) as exc:
        reason = " ".join(str(exc).split())[:200]
        raise CheckpointError(f"{path}: z-lab's DFlashDraftModel cannot load it ({reason})") from exc
    return model.eval()


class ZlabImplementation:
    name = "zlab"
    unsupported: frozenset[str] = frozenset(TRAINING_OPERATIONS)

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

        model = zlab.DFlashDraftModel(Qwen3Config(**zlab_config(spec)))
        model.load_state_dict(strip_wrapper_prefixes(state_dict), strict=True)
        return model.float().eval()

    def project_context(self, drafter, context_features):
        return drafter.hidden_norm(drafter.fc(context_features))

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

    def _unsupported(self, *_args, **_kwargs):
        raise Unsupported("zlab: dflash 0.1.0 ships no training code (anchors, training mask, loss, metrics)")

    select_anchors = training_mask = training_outputs = loss_weights = loss = block_metrics = _unsupported
    dpace_weights = dpace_loss = _unsupported

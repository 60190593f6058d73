"""vLLM as a source of rounds: the engine's captured steps (`serving_engines/live/engine_driver.py` writes them to
driver.json, the tensors beside it) read as rounds, blocks and what the drafter was fed, and each input or module
cited at its site in the installed vLLM.

A round is one engine step after the prefill: the tokens it adds (accepted drafts + the bonus). The engine's step s
(s >= 1) verifies what step s - 1 drafted: its captured context is that block, `rejected` of which the target
refused, so it added `len(context) - rejected` tokens. The last step is never followed by another capture: it added
whatever the output holds beyond the earlier rounds (the output is cut at max_tokens and at a stop token, as the
audit cuts its rounds).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

from dflash_audit.rounds.by_value import FedLocalizer
from dflash_audit.rounds.source import DrafterFeed, Localized, PromptRounds, RoundSource

# Where, in the engine, each kind of input or module is made (needle looked up in the installed file).
SITES = {
    "captured_layer": ("model_executor/models/interfaces.py", "value = hidden_states + residual if residual"),
    "aux_layer_ids": ("v1/worker/gpu/spec_decode/eagle/eagle3_utils.py", "def get_eagle3_aux_layers_from_config"),
    "mask_token": ("v1/spec_decode/llm_base_proposer.py", 'self.parallel_drafting_token_id = dflash_config["mask'),
    "block_length": ("v1/spec_decode/dflash.py", "num_query_per_req = 1 + self.num_speculative_tokens"),
    "positions": ("v1/spec_decode/dflash.py", "out_query_positions_ptr=self.positions"),
    "fc": ("model_executor/models/qwen3_dflash.py", "result = self.model.fc(hidden_states)"),
    "layers": ("model_executor/models/qwen3_dflash.py", "hidden_states, residual = layer("),
    "causal": ("model_executor/models/qwen3_dflash.py", "def _dflash_layer_causal"),
    "context_keys": ("model_executor/models/qwen3_dflash.py", "all_k_normed = self._normalize_context_k(all_k)"),
    "context_k_norm": ("model_executor/models/qwen3_dflash.py", "self._k_norm_weights,"),
    "norm": ("model_executor/models/qwen3_dflash.py", "hidden_states, _ = self.norm(hidden_states, residual)"),
    "drafts": ("v1/spec_decode/llm_base_proposer.py", "draft_token_ids, draft_probs = self._sample_draft_tokens("),
}


def served_rounds(steps: list[dict], output_length: int) -> list[int]:
    """Tokens added per engine step after the prefill (bonus included), summing to `output_length - 1`."""
    left = output_length - 1  # the prefill step gave the first token
    rounds = []
    for step in steps[1:]:
        if left <= 0:
            break
        added = len(step["context_tokens"]) - sum(step["rejected"] or [0])
        rounds.append(min(added, left))
        left -= rounds[-1]
    if left > 0:
        rounds.append(left)
    return rounds


def served_drafts(steps: list[dict], rounds: int) -> list[list[int]]:
    """The block each served round verified: drafted by the step before it (request 0 of a batch of one)."""
    return [list(step["drafts"][0]) for step in steps[:rounds]]


def step_feed(steps: list[dict], tensors: dict[str, torch.Tensor], index: int) -> DrafterFeed:
    """The drafter's inputs at engine step `index`, assembled from the captured steps up to it: each context row's
    features as the step that verified it captured them, the rows this step's fc projected, its module outputs."""
    rows: dict[int, torch.Tensor] = {}
    for step in steps[: index + 1]:
        aux = tensors[step["tensors"]["aux"]]
        keep = len(step["context_tokens"]) - sum(step["rejected"] or [0])
        for row, position in enumerate(step["context_positions"][:keep]):
            rows[position] = aux[row]
    step = steps[index]
    start = step["block_positions"][0]
    context = [p for p in sorted(rows) if p < start]
    keep = len(step["context_tokens"]) - sum(step["rejected"] or [0])
    return DrafterFeed(list(step["block_tokens"]), list(step["block_positions"]), context,
                       torch.stack([rows[p] for p in context]), step["context_positions"][:keep],
                       {name: tensors[key] for name, key in step["tensors"].items() if name != "aux"},
                       list(step.get("drafts", [[]])[0]))


def load_tensors(workdir: Path, name: str | None) -> dict[str, torch.Tensor]:
    if not name:
        return {}
    from safetensors.torch import load_file

    return load_file(str(workdir / name))


# How vLLM computes what a by-value finding names, where the finding's own words cannot know it.
HOW = {"k_norm": "vLLM norms every layer's context keys in one rms_norm call over the stacked k_norm weights"}


class StepsLocalizer:
    """By value (`FedLocalizer`) where the engine's tensors were captured; nothing to say where they were not."""

    def __init__(self, localizer: FedLocalizer | None):
        self.localizer = localizer

    def __call__(self, index: int, prompt: PromptRounds, audited, round_no: int) -> Localized:
        if self.localizer is None:
            return Localized()
        found = self.localizer(index, prompt, audited, round_no)
        found.findings = [replace(f, message=f"{f.message}; {HOW[f.key.rsplit('.', 1)[-1]]}")
                          if f.key.rsplit(".", 1)[-1] in HOW else f for f in found.findings]
        return found


def vllm_source(env, spec, model, target, variant: dict, prompts: list[dict], workdir: Path) -> RoundSource:
    """One engine run (`variant`: driver.json's steps and outputs per prompt, its tensors file in `workdir`) as a
    source of rounds on `prompts`; `model`: the drafter as trained, replayed on the engine's captured inputs."""
    tensors = load_tensors(workdir, variant.get("tensors"))

    def cite(kind: str) -> str:
        return env.cite(*SITES[kind])

    def feeder(steps: list[dict]):
        def feed(round_no: int) -> DrafterFeed | None:
            index = round_no - 1  # the step that drafted the block round `round_no` verified
            if index >= len(steps) or "block_tokens" not in steps[index]:
                return None
            return step_feed(steps, tensors, index)
        return feed

    rounds = []
    for p, prompt in enumerate(prompts[:len(variant["outputs"])]):
        steps, output = variant["steps"][p], variant["outputs"][p]
        served = served_rounds(steps, len(output))
        rounds.append(PromptRounds(prompt["id"], list(prompt["ids"]), served, served_drafts(steps, len(served)),
                                   list(output), feeder(steps)))
    localizer = FedLocalizer(model, target, cite) if tensors else None
    return RoundSource(f"vLLM {env.version}", spec.block_size - 1, rounds, StepsLocalizer(localizer))

"""The long-context faults (dflash_audit/audit/context_faults.py), each planted in an evaluator of its own and caught
as exactly one finding: the window ignored, the drafter's context capped at N, the block's positions rebased past
the trained length, a nested rope_theta read as a default. The planted evaluators are the live decoding loop with one
thing changed (the model it builds, its masks, its positions), not the audit's replay the finding comes from; the
sound one gives no finding.

The world's mixed drafter (window 48, trained on 256-token rows) on two held-out prompts and one of about 300 tokens,
so that blocks run past the window and past the trained length."""

from __future__ import annotations

import pytest
import torch

from dflash_audit.audit.context_faults import context_fault_finding
from dflash_audit.tau.along_context import ContextMarks, context_marks
from dflash_world.long_context import long_prompts
from drafter_files.checkpoint import load_checkpoint
from dflash_world.drafter import cached_test_drafter
from impl.body_shapes import build_drafter
from impl.decoding import dflash_decode
from impl.offline.cache import build_cache

MAX_NEW_TOKENS = 40
CAP = 64


@pytest.fixture(scope="module")
def long_setup(trained_pair, test_world):
    drafter, target, prompts, stop_ids = trained_pair
    if next(drafter.parameters()).dtype != torch.float32:
        pytest.skip("the planted faults are named by rounds equal to the replay's, which float32 alone guarantees")
    from foundation.target import load_tokenizer

    tokenizer, _ = load_tokenizer(test_world.target)
    longer = [(p["id"], tokenizer(p["prompt"], return_tensors="pt").input_ids) for p in long_prompts(tokenizer, (300,))]
    chosen = prompts[:2] + longer
    cache = build_cache("faults", target, chosen, drafter.target_layer_ids, MAX_NEW_TOKENS, stop_ids)
    ckpt = load_checkpoint(cached_test_drafter(test_world))
    marks = context_marks(ckpt.spec, ckpt.recipe)
    assert marks.trained_length == 256 and marks.sliding_window == 48
    assert max(entry.prompt_len for entry in cache.prompts) + MAX_NEW_TOKENS > 256  # past the trained length
    return drafter, target, chosen, stop_ids, cache, marks


def evaluate(drafter, target, prompts, stop_ids) -> dict[str, list[int]]:
    return {prompt_id: dflash_decode(drafter, target, ids, MAX_NEW_TOKENS, stop_ids).acceptance_lengths
            for prompt_id, ids in prompts}


def rebuilt(drafter, **changes):
    """An evaluator that builds the drafter from its own reading of the config."""
    return build_drafter(drafter.spec.replace(**changes), drafter.state_dict()).eval()


class CappedContext(torch.nn.Module):
    """An engine that keeps at most `cap` positions of the drafter's context: its masks hide every key further back."""

    def __init__(self, drafter, cap: int):
        super().__init__()
        self.inner, self.cap = drafter, cap

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.inner, name)

    def forward(self, noise, context, positions, masks=None, cache=None):
        cached = len(cache) if cache is not None else 0
        keys, block = cached + context.shape[1], noise.shape[1]
        q_pos = (keys + torch.arange(block))[:, None]
        near = q_pos - torch.arange(keys + block)[None] < self.cap
        own = self.inner.inference_masks(keys, block)
        masks = [near if m is None else m & near for m in own]
        return self.inner(noise, context, positions, masks=masks, cache=cache)


class RebasedBlock(CappedContext):
    """An engine that pulls the block's positions back past the trained length (the context keeps its own)."""

    def __init__(self, drafter, trained_length: int):
        super().__init__(drafter, cap=0)
        self.trained_length = trained_length

    def forward(self, noise, context, positions, masks=None, cache=None):
        block = noise.shape[1]
        anchor = int(positions[0, -block])
        shift = max(0, anchor + self.inner.block_size - self.trained_length)
        positions = torch.cat([positions[:, :-block], positions[:, -block:] - shift], dim=1)
        return self.inner(noise, context, positions, masks=masks, cache=cache)


def test_the_sound_evaluator_has_no_long_context_finding(long_setup):
    drafter, target, prompts, stop_ids, cache, marks = long_setup
    assert context_fault_finding(drafter, target, cache, evaluate(drafter, target, prompts, stop_ids), "eval.py",
                                 marks) is None


@pytest.mark.parametrize("fault", ["sliding window ignored", f"context capped at {CAP}",
                                   "block positions rebased past the trained length", "rope_theta read as a default"])
def test_each_planted_fault_is_one_finding_naming_it(long_setup, fault):
    drafter, target, prompts, stop_ids, cache, marks = long_setup
    planted = {
        "sliding window ignored": lambda: rebuilt(drafter, layer_types=("full_attention", "full_attention"),
                                                  sliding_window=None),
        f"context capped at {CAP}": lambda: CappedContext(drafter, CAP),
        "block positions rebased past the trained length": lambda: RebasedBlock(drafter, marks.trained_length),
        # The config nests rope_theta in rope_parameters; this evaluator reads a top-level one and falls back to
        # vLLM's default.
        "rope_theta read as a default": lambda: rebuilt(drafter, rope_theta=1_000_000.0),
    }[fault]()
    rounds = evaluate(planted, target, prompts, stop_ids)
    finding = context_fault_finding(drafter, target, cache, rounds, "eval.py", marks)
    assert finding is not None and finding.key == fault and finding.severity == "divergence", finding
    assert finding.message.startswith("eval.py ") and "first part at round" in finding.message
    if fault == "block positions rebased past the trained length":
        assert finding.raw["position"] + drafter.block_size > marks.trained_length
        assert "past the sliding window 48, trained length 256" in finding.message


def test_without_a_recorded_trained_length_no_position_variant_is_guessed(long_setup):
    drafter, target, prompts, stop_ids, cache, marks = long_setup
    unknown = ContextMarks(**{**marks.model_dump(), "trained_length": None})
    rounds = evaluate(RebasedBlock(drafter, marks.trained_length), target, prompts, stop_ids)
    assert context_fault_finding(drafter, target, cache, rounds, "eval.py", unknown) is None

"""τ along the context (dflash_audit/tau/along_context.py): the bins every τ report shows, counted as speculators'
acceptance_report.py counts them, the drafter's marks read from its spec and recipe (unknown where not recorded)."""

from __future__ import annotations

import pytest

from dflash_audit.tau.along_context import (ContextMarks, PromptRounds, context_marks, tau_along_context,
                                            trained_length)
from impl.recipe import Recipe
from tests.helpers import tiny_spec


def test_rounds_sit_at_their_anchor_and_bins_pool_them_bonus_included():
    """Prompt of 250 tokens: rounds at anchors 250, 253, 257 (= 250 + 3 + 4), 258; the first two fall in [0, 256),
    the others in [256, 512). τ per bin is tokens / rounds, the bonus token counted."""
    along = tau_along_context([PromptRounds(id="a", prompt_len=250, rounds=[3, 4, 1, 2])])
    assert [(b.start, b.end, b.rounds, b.tokens, b.tau) for b in along.by_position] == [
        (0, 256, 2, 7, 3.5), (256, 512, 2, 3, 1.5)]
    assert [(b.start, b.prompts, b.tau, b.tau_prompt_mean) for b in along.by_prompt_length] == [(0, 1, 2.5, 2.5)]


def test_prompt_length_bins_give_pooled_and_mean_of_prompts_and_are_settable():
    prompts = [PromptRounds(prompt_len=100, rounds=[1, 1, 1, 1]), PromptRounds(prompt_len=120, rounds=[5]),
               PromptRounds(prompt_len=700, rounds=[2, 2])]
    along = tau_along_context(prompts, bin_tokens=512, length_bin_tokens=128)
    assert along.bin_tokens == 512 and along.length_bin_tokens == 128
    first, second = along.by_prompt_length
    assert (first.start, first.end, first.prompts, first.rounds) == (0, 128, 2, 5)
    assert first.tau == pytest.approx(9 / 5) and first.tau_prompt_mean == pytest.approx((1 + 5) / 2)
    assert (second.start, second.tau) == (640, 2.0)
    assert [b.start for b in along.by_position] == [0, 512]


def test_target_agreement_is_binned_by_the_position_it_predicts():
    agreement = [True] * 255 + [False] * 10  # positions 1..255 agree, 256..265 do not
    along = tau_along_context([PromptRounds(prompt_len=266, rounds=[2], target_agreement=agreement)])
    first, second = along.by_position
    assert (first.agreement, first.agreement_positions, first.rounds, first.tau) == (1.0, 255, 0, None)
    assert (second.agreement, second.agreement_positions, second.rounds, second.tau) == (0.0, 10, 1, 2.0)


def test_marks_name_the_window_trained_length_and_rotary_and_what_each_bin_is_past():
    marks = ContextMarks(sliding_window=48, layer_types=["sliding_attention", "full_attention"], trained_length=256,
                         trained_length_source="recipe seq_len", rope_theta=1e6, max_position_embeddings=4096)
    along = tau_along_context([PromptRounds(prompt_len=10, rounds=[1]), PromptRounds(prompt_len=300, rounds=[1])],
                              marks=marks, bin_tokens=32)
    assert [b.past for b in along.by_position] == [[], ["sliding window 48", "trained length 256"]]
    text = along.table()
    assert "sliding window 48 (sliding_attention, full_attention)" in text and "trained length 256" in text
    assert along.to_dict()["schema"] == "dflash-audit/tau-along-context/1"


def test_trained_length_from_the_recipe_else_unknown():
    spec = tiny_spec(layer_types=("sliding_attention", "full_attention"), sliding_window=48, num_hidden_layers=2)
    assert context_marks(spec, Recipe().replace(extra={"seq_len": 256})).trained_length == 256
    unknown = context_marks(spec, Recipe())
    assert unknown.trained_length is None and "unknown" in unknown.describe()
    assert trained_length(None) == (None, "the checkpoint carries no recipe")
    assert context_marks(spec).sliding_window == 48


def test_a_round_that_adds_nothing_is_an_error():
    with pytest.raises(ValueError, match="adds no token"):
        tau_along_context([PromptRounds(id="p", prompt_len=4, rounds=[2, 0])])

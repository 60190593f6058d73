"""The rounds core (`dflash_audit/rounds/`) with no engine: a source of rounds built from a recorded decoding loop is
held to the audit's replay of z-lab's loop, and its first parting round localized by value on what its drafter was
fed. The sources are the test world's all-full drafter run by `impl.decoding.dflash_decode`, as an evaluator would
record it: once sound, once with the context features taken one target layer lower (the evaluator fault "positions
shifted" of a layer list read off by one)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

PROMPTS, TOKENS = 3, 32


@pytest.fixture(scope="module")
def world(test_world):
    from dflash_audit.audit.drafter_fit import place_drafter, read_drafter
    from dflash_audit.rounds.replay import load_prompts_for, zlab_replay
    from dflash_world.drafter import cached_full_drafter
    from foundation.target import load_target
    from foundation.target_vocab import stop_token_ids

    target, tokenizer = load_target(test_world.target)
    path = Path(cached_full_drafter(test_world))
    drafter = place_drafter(*read_drafter(path, Path(test_world.target), target.config), path, target)
    prompts = load_prompts_for(Path(test_world.target), Path(test_world.prompts), tokenizer)[:PROMPTS]
    stops = stop_token_ids(test_world.target, tokenizer).ids
    with torch.inference_mode():
        audited = zlab_replay(drafter, target, prompts, TOKENS, stops)
    return drafter, target, prompts, stops, audited


def recorded(drafter, target, prompts, stops, layer_ids: list[int]):
    """An evaluator's record: per prompt the accepted count and the block of each round, its output, and what its
    drafter read as context features (its target layers `layer_ids`: hidden_states[id + 1] of each)."""
    from dflash_audit.rounds import DrafterFeed, PromptRounds
    from dflash_audit.rounds.replay import built, zlab_replay
    from impl.layers import hidden_state_index

    spec = drafter.spec.replace(target_layer_ids=layer_ids)
    model = built(spec, drafter.state_dict(), target)
    with torch.inference_mode():
        runs = zlab_replay(model, target, prompts, TOKENS, stops)
    records = []
    for prompt, run in zip(prompts, runs, strict=True):
        tokens = prompt["ids"] + run.new_tokens
        with torch.inference_mode():
            hidden = target(torch.tensor([tokens]), output_hidden_states=True).hidden_states
        features = torch.cat([hidden[hidden_state_index(i)][0].float() for i in layer_ids], dim=-1)
        starts = [len(prompt["ids"]) + sum(run.acceptance_lengths[:r]) for r in range(len(run.acceptance_lengths))]

        def feed(round_no: int, starts=starts, tokens=tokens, features=features, blocks=run.extra["proposals"]):
            start = starts[round_no - 1]
            size = spec.block_size
            return DrafterFeed([tokens[start]] + [spec.mask_token_id] * (size - 1), list(range(start, start + size)),
                               list(range(start)), features[:start], drafts=blocks[round_no - 1])

        records.append(PromptRounds.from_accepted(prompt["id"], prompt["ids"],
                                                  [length - 1 for length in run.acceptance_lengths], run.new_tokens,
                                                  run.extra["proposals"], feed=feed))
    return records


def evaluator(world, layer_ids):
    from dflash_audit.rounds import RoundSource
    from dflash_audit.rounds.by_value import FedLocalizer

    drafter, target, prompts, stops, _ = world
    return RoundSource("eval.py", drafter.spec.block_size - 1, recorded(drafter, target, prompts, stops, layer_ids),
                       FedLocalizer(drafter, target, lambda kind: f"eval.py ({kind})"))


def test_a_sound_evaluator_is_z_labs_loop_round_for_round(world):
    from dflash_audit.rounds import assess

    drafter, *_, audited = world
    assessed = assess(evaluator(world, list(drafter.spec.target_layer_ids)), audited)
    assert assessed.findings == [] and assessed.greedy_identical is None
    for row, run in zip(assessed.rows, audited, strict=True):
        assert row["first_diff_round"] is None and row["served_rounds"] == run.acceptance_lengths, row
        assert row["blocks_equal"] == row["rounds"] - row["rounds_apart"] and row["served_tau"] == row["audited_tau"]
    assert assessed.per_position["served"] == assessed.per_position["audited"]
    assert len(assessed.per_position["served"]) == drafter.spec.block_size - 1


def test_an_evaluator_reading_each_layer_one_lower_is_localized_at_its_first_parting_round(world):
    """The evaluator's rounds part from z-lab's; at each prompt's first parting round what its drafter was fed names
    the fault by value: every declared layer is the output of the layer below (one finding per layer, merged over
    the prompts), cited at the evaluator's own site."""
    from dflash_audit.rounds import assess

    drafter, *_, audited = world
    ids = list(drafter.spec.target_layer_ids)
    assessed = assess(evaluator(world, [i - 1 for i in ids]), audited)
    parted = [row for row in assessed.rows if row["first_diff_round"] is not None]
    assert parted, "reading the layers one lower changed no round"
    assert {f.key for f in assessed.findings} == {f"target_layer:{i}" for i in ids}, assessed.findings
    for finding in assessed.findings:
        assert finding.kind == "input" and "shifted by -1" in finding.message
        assert finding.source == "eval.py (captured_layer)"
        assert finding.localized["prompts"] == [row["id"] for row in parted]
        assert finding.localized["rounds"] == [row["first_diff_round"] for row in parted]
    assert all(row["explained_by"] == [f"target_layer:{i}" for i in ids] for row in parted)


def test_rounds_from_accepted_counts_stop_where_the_output_does():
    from dflash_audit.rounds import PromptRounds

    # 1 (prefill) + 3 + 1 + 2 tokens: the last verification's 3 accepted cut to the 2 the budget left.
    cut = PromptRounds.from_accepted("p", [5], [2, 0, 3], output=list(range(7)))
    assert cut.rounds == [3, 1, 2] and cut.tau == 2.0
    # A last verification that drafted nothing: the output's last token is one more round.
    assert PromptRounds.from_accepted("p", [5], [1], output=list(range(4))).rounds == [2, 1]
    assert PromptRounds.from_accepted("p", [5], [1, 4]).rounds == [2, 5]


def test_acceptance_per_position_counts_a_shrunk_last_block_only_where_it_drafted():
    """The one definition (engines' live sections and an evaluator's T > 0 table alike): position j over the rounds
    that drafted it; z-lab's last blocks, shrunk to the tokens left, are no rejection past what they drafted."""
    from dflash_audit.rounds.match import per_position
    from dflash_audit.trace.evaluation.tau import acceptance, position_gaps

    # Three whole blocks of 3 drafts (adding 4, 1, 3 tokens), then a last block of 1 draft that was accepted (2).
    assert per_position([4, 1, 3, 2], [3, 3, 3, 1]) == [3 / 4, 2 / 3, 1 / 3]
    assert per_position([2], [1], positions=3) == [1.0, None, None]  # never drafted: unknown, not 0
    # The evaluator's table: the same numbers from its prompts' (added, drafted) rounds.
    rounds = [[(4, 3), (1, 3)], [(3, 3), (2, 1)]]
    assert acceptance(rounds, 3) == [3 / 4, 2 / 3, 1 / 3]
    gaps = position_gaps(rounds, rounds, 4)
    assert [g.mean for g in gaps[:3]] == [0.0, 0.0, 0.0] and gaps[3] is None


def test_findings_are_records_until_written():
    from catalogue.findings import Finding, serialized
    from dflash_audit.tau.declared import template_findings

    (chat,) = template_findings({"enable_thinking": False}, "config.json", {"thinking on": {"enable_thinking": True},
                                                                           "thinking off": {"enable_thinking": False}})
    assert isinstance(chat, Finding) and (chat.ours, chat.ref) == ({"enable_thinking": False},
                                                                   {"enable_thinking": True})
    local = Finding.localization("input", "mask_token_id", "m", None, "s", "p1", 2)
    written = serialized({"findings": [local], "planted": {"x": {"findings": [chat]}}, "n": 1})
    assert written == {"findings": [local.to_dict()], "planted": {"x": {"findings": [chat.to_dict()]}}, "n": 1}
    assert written["planted"]["x"]["findings"][0]["chat"] == "thinking on"


@pytest.mark.parametrize("scale, kind", [(1e-4, "tie"), (1.0, "unlocalized")])
def test_a_source_drafting_the_runner_up_is_a_near_tie_only_where_the_top_two_are_that_close(world, scale, kind):
    """Fed as trained, every module as trained, one draft the runner-up: an argmax near-tie (info) where the
    drafter's top two are within TIE_MARGIN there (its logits scaled by 1e-4: every margin a near-tie), else a
    difference the by-value localization leaves `unlocalized`, with its margin."""
    from dflash_audit.rounds import DrafterFeed
    from dflash_audit.rounds.by_value import module_findings, replay
    from dflash_audit.rounds.replay import built
    from dflash_audit.rounds.ties import TIE_MARGIN
    from impl.layers import hidden_state_index

    drafter, target, prompts, _, audited = world
    spec = drafter.spec.replace(output_multiplier=drafter.spec.output_multiplier * scale)
    model = built(spec, drafter.state_dict(), target)
    tokens = prompts[0]["ids"] + audited[0].new_tokens
    start, size = len(prompts[0]["ids"]), spec.block_size
    with torch.inference_mode():
        hidden = target(torch.tensor([tokens]), output_hidden_states=True).hidden_states
    features = torch.cat([hidden[hidden_state_index(i)][0, :start].float() for i in spec.target_layer_ids], dim=-1)
    feed = DrafterFeed([tokens[start]] + [spec.mask_token_id] * (size - 1), list(range(start, start + size)),
                       list(range(start)), features)
    runner_up = replay(model, target, feed)["logits"].float().topk(2, dim=-1).indices[:, 1].tolist()
    feed.drafts = replay(model, target, feed)["logits"].argmax(-1).tolist()
    feed.drafts[0] = runner_up[0]
    (finding,) = module_findings(model, target, feed, lambda what: f"eval.py ({what})", prompts[0]["id"], 1)
    assert finding.kind == kind, finding
    assert (finding.served < TIE_MARGIN) == (kind == "tie")


def test_a_live_section_reports_tau_along_the_context_beside_the_replay():
    """A live section's rows (the one assessment's) binned on both sides by each round's anchor (the prompt's length
    + the tokens of the earlier rounds, the bonus counted), in the bins asked for, the target's agreement beside the
    replay's side: the same for every engine (`live_report.along_context`)."""
    from dflash_audit.audit.live_report import along_context
    from dflash_audit.rounds import PromptRounds, RoundSource, assess
    from dflash_audit.tau.along_context import ContextMarks
    from impl.decoding import DecodeResult

    prompt = [7] * 300
    source = RoundSource("engine", 3, [PromptRounds("p", prompt, [4, 4, 1, 2])])
    replay = DecodeResult(torch.zeros(1, 312, dtype=torch.long), 300, [4, 4, 3], {"proposals": [[1] * 3] * 3})
    marks = ContextMarks(sliding_window=48, layer_types=["sliding_attention"])
    along = along_context(assess(source, [replay]).rows, marks, 8, {"p": [True] * 150 + [False] * 149})
    assert list(along) == ["audited", "served"]
    served, audited = along["served"], along["audited"]
    assert served["bin_tokens"] == audited["bin_tokens"] == 8
    # served rounds anchored at 300, 304, 308, 309: bins 296 (one round of 4), 304 (4 + 1 + 2 tokens over 3 rounds)
    assert [(b["start"], b["rounds"], b["tokens"]) for b in served["by_position"]] == [(296, 1, 4), (304, 3, 7)]
    assert [(b["start"], b["rounds"], b["tokens"]) for b in audited["by_position"] if b["rounds"]] == [(296, 1, 4),
                                                                                                      (304, 2, 7)]
    assert all(b["agreement"] is None for b in served["by_position"])
    agreed = {b["start"]: b["agreement"] for b in audited["by_position"]}
    assert agreed[0] == 1.0 and agreed[152] == 0.0  # positions 1..150 agreed, 151.. not
    assert served["by_position"][0]["past"] == ["sliding window 48"] and served["marks"]["sliding_window"] == 48


def test_an_engines_context_is_what_the_prompts_need():
    """The engine's context (vLLM's max_model_len, llama-server's -c): the longest prompt, its new tokens and room
    for one whole block (and the two tokens llama.cpp keeps), within the target's positions."""
    from serving_engines.live.host import context_length

    prompts = [{"id": "a", "ids": [1] * 1000}, {"id": "b", "ids": [1] * 4000}]
    assert context_length(prompts, 32, 8, 8192) == 4000 + 32 + 8 + 2
    assert context_length(prompts, 32, 8, 4036) == 4036  # the room is what the target's positions leave
    assert context_length(prompts, 32) == 4032


def test_a_live_prompt_past_the_targets_positions_is_refused_as_eval_refuses_it(test_world, tmp_path):
    from dflash_audit.rounds.replay import load_prompts_for
    from foundation.errors import AuditError
    from foundation.target import load_tokenizer

    tokenizer, config = load_tokenizer(test_world.target)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": "long", "prompt": "' + "word " * 4000 + '"}\n')
    assert len(load_prompts_for(test_world.target, prompts, tokenizer)[0]["ids"]) > config.max_position_embeddings - 8
    with pytest.raises(AuditError, match=r"prompt 'long' has \d+ tokens \+ --max-new-tokens 8 = \d+, beyond the "
                                         r"target's max_position_embeddings"):
        load_prompts_for(test_world.target, prompts, tokenizer, 8, config.max_position_embeddings)


def test_the_one_near_tie_rule():
    """impl/near_tie.py, the rule every parting is judged by (the offline walks, the engines, a traced evaluator):
    float32 ties only between other kernels, within KERNEL_MARGIN; below it, the two sides' inputs within
    ROUNDING_ULPS and the gap within what their difference moves the scores; unmeasured is no tie."""
    from impl.near_tie import KERNEL_MARGIN, ROUNDING_ULPS, near_tie, ulps_apart
    from impl.offline.walks import Mismatch, Parting, unexplained_partings

    assert near_tie(KERNEL_MARGIN / 2, torch.float32) and not near_tie(KERNEL_MARGIN * 2, torch.float32)
    assert not near_tie(0.0, torch.float32, same_kernels=True)  # our two loops: the same kernels, no tie
    bf16 = torch.bfloat16
    assert near_tie(0.05, bf16, moved=0.1, ulps=ROUNDING_ULPS) and not near_tie(0.2, bf16, moved=0.1, ulps=1)
    assert not near_tie(0.05, bf16, moved=0.1, ulps=ROUNDING_ULPS + 1) and not near_tie(1e-6, bf16)
    one = torch.tensor([1.0, 2.0])
    assert ulps_apart(one + torch.tensor([0.0, 2 * torch.finfo(bf16).eps]), one, bf16) == pytest.approx(1.0, rel=0.01)
    # The offline walks' partings are judged by it: a replay walking as the live loop from its features, within
    # the rounding and the gap within what it moves, is explained below float32; never in float32.
    parting = Parting(Mismatch("p", 1, 10, 0.0), 2.0, True, 0.05, 0.1)
    assert unexplained_partings([parting], bf16) == [] and len(unexplained_partings([parting], torch.float32)) == 1
    assert len(unexplained_partings([Parting(Mismatch("p", 1, 10, 0.0), 2.0, False, 0.05, 0.1)], bf16)) == 1


@pytest.mark.parametrize("ulps, slot_by, kind", [(4, min, "tie"), (4, max, "unlocalized"), (64, min, "unlocalized")])
def test_below_float32_a_runner_up_draft_is_judged_by_the_one_near_tie_rule(world, ulps, slot_by, kind):
    """In bfloat16 an engine fed the target's states rounded apart (seeded noise of `ulps` ulps) that drafts the
    runner-up at the slot of the smallest (largest) top-two gap: a near-tie only where its features are within
    ROUNDING_ULPS of the trained ones and the gap within what they move the drafter's scores (the offline walks'
    rule), measured on the trained drafter replayed on both; never the float32 kernel margin."""
    import copy

    from dflash_audit.rounds import DrafterFeed
    from dflash_audit.rounds.by_value import TargetReplay, module_findings, replay, trained_features
    from dflash_audit.rounds.replay import built

    drafter, target, prompts, _, audited = world
    target = copy.deepcopy(target).to(torch.bfloat16)
    model = built(drafter.spec, drafter.state_dict(), target)
    tokens = prompts[0]["ids"] + audited[0].new_tokens
    start, size = len(prompts[0]["ids"]), drafter.spec.block_size
    states = TargetReplay(target, tokens)
    feed = DrafterFeed([tokens[start]] + [drafter.spec.mask_token_id] * (size - 1), list(range(start, start + size)),
                       list(range(start)), torch.zeros(start, 1))
    trained = trained_features(states, drafter.spec, feed)
    noise = torch.rand(trained.shape, generator=torch.Generator().manual_seed(0)) * 2 - 1
    feed.features = (trained + ulps * torch.finfo(torch.bfloat16).eps * trained.abs() * noise).to(torch.bfloat16)
    logits = replay(model, target, feed)["logits"].float()
    top2 = logits.topk(2, dim=-1)
    gaps = (top2.values[:, 0] - top2.values[:, 1]).tolist()
    slot = gaps.index(slot_by(gaps))
    feed.drafts = logits.argmax(-1).tolist()
    feed.drafts[slot] = int(top2.indices[slot, 1])
    (finding,) = module_findings(model, target, feed, lambda what: f"engine ({what})", prompts[0]["id"], 1, states)
    assert finding.kind == kind, finding
    if kind == "tie":  # judged by what the rounding moves, not by the float32 kernels' margin
        assert "ulps of bfloat16 from the trained ones, move them" in finding.message, finding.message
        assert "apart (within 0.001)" not in finding.message

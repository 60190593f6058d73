"""Dynamic audit on the test world's trained target: per-prompt τ of both drafters, τ findings, unrunnable drafters."""

from __future__ import annotations

import json

import pytest
import torch

from dflash_audit.audit import tau_stats
from dflash_audit.audit.dynamic import MethodResult, PromptTau, tau_finding
from dflash_world.suite_placement import audit_dtype
from foundation.placement import dtype_name
from tests.helpers import compare_on_world, world_drafter


def method_result(ours_rounds: list[list[int]], ref_rounds: list[list[int]]) -> MethodResult:
    prompts = [PromptTau(f"p{i}", tau_stats.tau(o), tau_stats.tau(r), o, r, tau_stats.first_divergent_round(o, r))
               for i, (o, r) in enumerate(zip(ours_rounds, ref_rounds))]
    return MethodResult("dflash", None, {"ours": 8, "ref": 8}, prompts)


def test_tau_gap_beyond_noise_is_a_divergence():
    ours = [[1, 2, 1], [2, 1, 1], [1, 1, 2], [2, 2, 1], [1, 1, 1], [1, 2, 2]]
    ref = [[o + 2 for o in rounds] for rounds in ours]
    finding = tau_finding(method_result(ours, ref))
    assert finding.component == "tau" and finding.severity == "divergence" and finding.ref > finding.ours
    interval = method_result(ours, ref).interval()
    assert interval.low > 0 and interval.beyond_noise


def test_tau_gap_within_noise_is_info():
    ours = [[1, 3], [3, 1], [2, 2], [1, 2]]
    ref = [[3, 1], [1, 3], [2, 2], [2, 1]]  # per-prompt gaps of both signs around zero
    assert tau_finding(method_result(ours, ref)).severity == "info"


def test_statistics():
    rounds = [[1, 3, 8], [2]]
    assert tau_stats.acceptance_histogram(rounds, 8) == [0, 1, 1, 1, 0, 0, 0, 0, 1]
    assert tau_stats.position_acceptance(rounds, 4)[:2] == [3 / 4, 2 / 4]
    assert tau_stats.first_divergent_round([1, 2, 3], [1, 2, 4]) == 2
    assert tau_stats.first_divergent_round([1, 2], [1, 2]) is None


@pytest.mark.dynamic
def test_tau_measured_per_prompt_for_both(test_world, tmp_path):
    ours, ref = world_drafter(test_world, (1,), 0), world_drafter(test_world, (1, 2), 1)
    report = compare_on_world(test_world, tmp_path, ours, ref, out=tmp_path / "out", max_new_tokens=16, budget=8,
                              tau_bin_tokens=32)
    data = json.loads((tmp_path / "out" / "report.json").read_text())
    n_prompts = sum(1 for line in test_world.prompts.read_text().splitlines() if line.strip())
    assert len(data["tau"]["prompts"]) == n_prompts
    for prompt in data["tau"]["prompts"]:
        assert set(prompt) >= {"id", "ours", "ref", "ours_rounds", "ref_rounds"}
        for side in ("ours", "ref"):
            rounds = prompt[f"{side}_rounds"]
            assert rounds and all(1 <= r <= 8 for r in rounds)
            assert abs(prompt[side] - sum(rounds) / len(rounds)) < 1e-12
    assert set(data["tau"]["methods"]) == {"dflash", "ddtree"}
    # z-lab's stop ids, with their source: the world's generation config says eos 0, falsy in z-lab's `or`
    assert data["tau"]["stop_ids"] == [0] and "tokenizer's eos_token_id" in data["tau"]["stop_id_sources"]["0"]
    assert "stopping at the target's ids 0 (the tokenizer&#39;s eos_token_id" in (
        tmp_path / "out" / "index.html").read_text()
    assert data["tau"]["precision"]["target_dtype"] == dtype_name(audit_dtype())  # the suite's, via --dtype auto
    # Below float32 the report says offline τ is the live loop's only up to drafter near-ties (docs/gpus.md).
    exactness = data["tau"]["precision"].get("offline_exactness")
    assert (exactness is None) == (audit_dtype() == torch.float32)
    assert exactness is None or ("near-ties" in exactness and dtype_name(audit_dtype()) in exactness)
    ddtree = report.dynamic.methods["ddtree"]
    assert ddtree.budget == 8 and all(p.ours_rounds for p in ddtree.prompts)
    # τ along the context, per method and side, beside the target's greedy agreement; a curve in the HTML.
    for method, result in data["tau"]["methods"].items():
        for side in ("ours", "ref"):
            along = result["along_context"][side]
            assert sum(b["rounds"] for b in along["by_position"]) == sum(len(p[f"{side}_rounds"])
                                                                         for p in result["prompts"])
            assert any(b["agreement"] is not None for b in along["by_position"])
            # --tau-bin-tokens 32: every bin that wide, from 0
            assert along["bin_tokens"] == 32 and all(b["start"] % 32 == 0 and b["end"] == b["start"] + 32
                                                     for b in along["by_position"] + along["by_prompt_length"])
    assert 'class="chart along-chart"' in (tmp_path / "out" / "index.html").read_text()
    assert any(f.component == "tau" for f in report.findings)


@pytest.mark.dynamic
def test_nan_drafter_still_gets_a_report(test_world, tmp_path):
    ours, ref = world_drafter(test_world, (1, 2), 0), world_drafter(test_world, (1, 2), 1)
    with torch.no_grad():
        ours.fc.weight[0, 0] = float("nan")
    compare_on_world(test_world, tmp_path, ours, ref, out=tmp_path / "out", max_new_tokens=8, budget=4)
    data = json.loads((tmp_path / "out" / "report.json").read_text())
    components = {(f["component"], f["severity"]) for f in data["findings"]}
    assert ("weights", "divergence") in components  # the static finding stands
    warning = next(f for f in data["findings"] if f["component"] == "tau" and f["severity"] == "warning")
    assert "not measured" in warning["message"] and "non-finite" in warning["message"]
    assert data["tau"]["mean"]["ours"] is None and data["tau"]["mean"]["ref"] is not None
    assert (tmp_path / "out" / "index.html").is_file()


def test_dtype_list_gives_tau_per_dtype_and_flags_an_fc_that_overflows_float16(test_world, tmp_path):
    """fc scaled by 1e6: hidden_norm undoes any scale in float32 (the same τ as unscaled), but the fc
    output passes float16's 65504 and turns to inf there."""
    from dflash_audit.cli import main
    from dflash_world.drafter import cached_test_drafter
    from drafter_files.checkpoint import load_checkpoint, save_state

    ckpt = load_checkpoint(cached_test_drafter(test_world))
    scaled = dict(ckpt.state_dict, **{"fc.weight": ckpt.state_dict["fc.weight"] * 1e6})
    save_state(tmp_path / "ours.pt", ckpt.spec, scaled)
    prompts = tmp_path / "four.jsonl"
    prompts.write_text("\n".join(test_world.prompts.read_text().splitlines()[:4]) + "\n")
    code = main([str(a) for a in ["compare", "--ours", tmp_path / "ours.pt", "--ref", cached_test_drafter(test_world),
                                  "--target", test_world.target, "--prompts", prompts, "--max-new-tokens", 16,
                                  "--budget", 4, "--dtype", "float32,float16", "--device", "cpu",
                                  "--out", tmp_path / "out", "--cache-dir", tmp_path / "cache"]])
    assert code == 1  # the drafters agree in float32, but ours cannot be served in float16: a divergence
    data = json.loads((tmp_path / "out" / "report.json").read_text())
    tau = data["tau"]
    assert tau["precision"] == {"device": "cpu", "target_dtype": "float32", "drafter_dtype": "float32",
                                "device_map": None, "dtype_source": "--dtype",
                                "attention": "default"}
    assert set(tau["by_dtype"]) == {"float32", "float16"}
    assert tau["by_dtype"]["float32"]["overflow"] == {}
    assert tau["by_dtype"]["float16"]["overflow"] == {"ours": "fc"}  # the first module that overflowed
    assert tau["by_dtype"]["float16"]["precision"]["drafter_dtype"] == "float16"
    assert "near-ties" in tau["by_dtype"]["float16"]["precision"]["offline_exactness"]
    fp32 = tau["by_dtype"]["float32"]["means"]["dflash"]
    assert fp32["ours"] == fp32["ref"]  # in float32 the scale is invisible
    divergences = [f for f in data["findings"] if f["severity"] == "divergence"]
    assert [f["key"] for f in divergences] == ["overflow (ours, float16)"]  # one root cause, one finding
    assert "fc produced non-finite" in divergences[0]["message"]
    # its τ drop in float16 is the overflow's doing: not a second finding
    assert not any(f["key"].startswith("dtype drop (ours") for f in data["findings"])
    assert not any("(ref" in f["key"] for f in data["findings"] if f["component"] == "tau")
    html = (tmp_path / "out" / "index.html").read_text()
    assert "τ per dtype" in html and "ours: fc" in html

"""Static audit and `dflash-audit compare` on crafted pairs of tiny drafters (no target needed)."""

from __future__ import annotations

import json

import pytest
import torch

from dflash_audit.audit.dynamic import DynamicAudit, MethodResult, PromptTau
from dflash_audit.audit.report import AuditReport
from dflash_audit.audit.report_html import render_html
from dflash_audit.audit.sides import load_side
from dflash_audit.audit.static import static_audit
from dflash_audit.cli import main
from foundation.packages import PACKAGES
from drafter_files.checkpoint import save_checkpoint
from impl.model import DFlashDrafter
from impl.recipe import Recipe
from drafter_files.zlab_format import save_zlab_dir
from tests.helpers import tiny_spec, tiny_target


def drafter(seed: int = 0, **overrides) -> DFlashDrafter:
    torch.manual_seed(seed)
    return DFlashDrafter(tiny_spec(**overrides))


def audit(tmp_path, ours: DFlashDrafter, ref: DFlashDrafter, ours_recipe=None, expect_identical=False,
          ours_state=None):
    save_checkpoint(tmp_path / "ours.pt", ours, recipe=ours_recipe)
    if ours_state is not None:  # a hand-edited state dict
        payload = torch.load(tmp_path / "ours.pt", weights_only=True)
        payload["model"] = ours_state
        torch.save(payload, tmp_path / "ours.pt")
    save_zlab_dir(tmp_path / "ref", ref.spec, ref.state_dict())
    return static_audit(load_side(tmp_path / "ours.pt"), load_side(tmp_path / "ref"), expect_identical)


def kinds(result, severity="divergence"):
    return sorted((f.component, f.key) for f in result.findings if f.severity == severity)


def test_fc_fed_fewer_layers_is_one_fc_dims_finding(tmp_path):
    result = audit(tmp_path, drafter(target_layer_ids=(1, 3)), drafter(1))
    assert kinds(result) == [("fc_dims", "")]
    finding = result.findings[0]
    assert finding.pitfall == 4 and "leaves out target layer 4 (the deepest)" in finding.message
    fc = next(r for r in result.tensor_rows if r.key == "fc.weight")
    assert fc.status == "shape" and fc.explained_by == "fc_dims"  # not again under weights


def test_shifted_target_layers_point_at_the_index_convention(tmp_path):
    result = audit(tmp_path, drafter(target_layer_ids=(0, 2, 3)), drafter(1))
    assert kinds(result) == [("target_layers", "")]
    assert result.findings[0].pitfall == 2


@pytest.mark.parametrize("overrides, expected, pitfall", [
    (dict(block_size=4), ("block_size", ""), 16),
    (dict(mask_token_id=3), ("mask_token", ""), 14),
    (dict(layer_types=("full_attention",) * 3), ("layer_types", ""), 11),
    (dict(sliding_window=4), ("layer_types", "sliding_window"), 11),
    (dict(intermediate_size=96), ("architecture", "intermediate_size"), None),
    (dict(rope_theta=500_000.0), ("rotary", "rope_theta"), 35),
    (dict(rope_scaling={"rope_type": "linear", "factor": 2.0}), ("rotary", "rope_scaling"), 35),
])
def test_each_config_difference_is_its_own_finding(tmp_path, overrides, expected, pitfall):
    result = audit(tmp_path, drafter(**overrides), drafter(1))
    assert kinds(result) == [expected]
    assert next(f for f in result.findings if f.severity == "divergence").pitfall == pitfall
    assert not [r for r in result.tensor_rows if r.status == "shape" and not r.explained_by]


def test_fewer_draft_layers_is_architecture_not_weights(tmp_path):
    ours = drafter(num_hidden_layers=2, layer_types=("sliding_attention", "full_attention"))
    result = audit(tmp_path, ours, drafter(1))
    assert kinds(result) == [("architecture", "num_hidden_layers")]
    missing = [r for r in result.tensor_rows if r.status == "missing in ours"]
    assert missing and all(r.key.startswith("layers.2.") and r.explained_by == "architecture" for r in missing)


def test_weight_problems(tmp_path):
    ours = drafter()
    state = {k: v.clone() for k, v in ours.state_dict().items()}
    del state["layers.1.mlp.up_proj.weight"]
    state["layers.0.self_attn.q_proj.weight"][0, 0] = float("nan")
    state["norm.weight"] = state["norm.weight"].to(torch.bfloat16)
    result = audit(tmp_path, ours, drafter(1), ours_state=state)
    assert kinds(result) == [("weights", "missing in ours"), ("weights", "non-finite in ours")]
    assert ("weights", "dtype") in kinds(result, "warning")


def test_recipe_against_reference_defaults(tmp_path):
    recipe = Recipe(gamma=7.0, verifier_source_layer=3, max_anchors=256)
    result = audit(tmp_path, drafter(), drafter(), ours_recipe=recipe)
    assert kinds(result) == [("recipe", "gamma"), ("recipe", "verifier_source_layer")]
    assert kinds(result, "warning") == [("recipe", "max_anchors")]
    gamma = next(f for f in result.findings if f.key == "gamma")
    assert gamma.ref == 4.0 and "speculators 0.9.0" in gamma.message and gamma.pitfall == 6


def test_final_layer_recipe_matches_the_default(tmp_path):
    result = audit(tmp_path, drafter(), drafter(), ours_recipe=Recipe(verifier_source_layer=5))
    assert kinds(result) == [] and kinds(result, "warning") == []


def test_values_are_info_unless_expect_identical(tmp_path):
    ours, ref = drafter(0), drafter(0)
    with torch.no_grad():
        ref.fc.weight.add_(1e-3)
    assert kinds(audit(tmp_path, ours, ref)) == []
    assert ("weights", "values") in kinds(audit(tmp_path, ours, ref), "info")
    assert kinds(audit(tmp_path, ours, ref, expect_identical=True)) == [("weights", "values")]
    assert kinds(audit(tmp_path, ours, drafter(0), expect_identical=True)) == []


def test_speculators_conversion_of_a_zlab_dir_is_no_divergence(tmp_path):
    from speculators.convert.dflash.converter import DFlashConverter

    ref = drafter(3)
    save_zlab_dir(tmp_path / "zlab", ref.spec, ref.state_dict())
    tiny_target(num_layers=ref.spec.num_target_layers).save_pretrained(tmp_path / "target")
    DFlashConverter().convert(tmp_path / "zlab", tmp_path / "spec", base_model=str(tmp_path / "target"))
    converted = load_side(tmp_path / "spec", tmp_path / "target")
    result = static_audit(converted, load_side(tmp_path / "zlab"), expect_identical=True)
    assert converted.layer_id_convention == "speculators" and converted.raw_layer_ids != list(ref.spec.target_layer_ids)
    assert kinds(result) == [] and kinds(result, "warning") == []


def test_exit_codes_and_report_files(tmp_path, capsys):
    same, other = drafter(0), drafter(0, block_size=4)
    save_checkpoint(tmp_path / "a.pt", same)
    save_zlab_dir(tmp_path / "same", same.spec, same.state_dict())
    save_zlab_dir(tmp_path / "other", other.spec, other.state_dict())
    out = tmp_path / "out"
    assert main(["compare", "--ours", str(tmp_path / "a.pt"), "--ref", str(tmp_path / "same"), "--out", str(out),
                 "--json", str(tmp_path / "extra.json")]) == 0
    report = json.loads((out / "report.json").read_text())
    assert set(report) >= {"schema", "ours", "ref", "findings", "tau", "versions"}
    assert report["schema"] == "dflash-audit/1" and set(report["ours"]) >= {"path", "format", "spec"}
    assert list(report["versions"]) == [package.name for package in PACKAGES]  # foundation/packages.py, the one table
    assert json.loads((tmp_path / "extra.json").read_text())["findings"] == report["findings"]
    assert (out / "index.html").is_file()
    assert main(["compare", "--ours", str(tmp_path / "a.pt"), "--ref", str(tmp_path / "other"), "--out", str(out)]) == 1
    finding = json.loads((out / "report.json").read_text())["findings"][0]
    assert set(finding) >= {"component", "severity", "message", "ours", "ref"} and finding["component"] == "block_size"
    capsys.readouterr()
    assert main(["compare", "--ours", str(tmp_path / "missing.pt"), "--ref", str(tmp_path / "same")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("dflash-audit: error:") and len(err.splitlines()) == 1


def test_html_escapes_paths_and_prompt_ids(tmp_path):
    evil = "<script>alert(1)</script>"
    ours, ref = drafter(0), drafter(1)
    save_checkpoint(tmp_path / "ours.pt", ours)
    (tmp_path / evil.replace("/", "_")).mkdir()
    ref_dir = tmp_path / evil.replace("/", "_") / "ref"
    save_zlab_dir(ref_dir, ref.spec, ref.state_dict())
    sides = load_side(tmp_path / "ours.pt"), load_side(ref_dir)
    report = AuditReport(*sides, static_audit(*sides))
    method = MethodResult("dflash", None, {"ours": 8, "ref": 8},
                          [PromptTau('<img src=x onerror="alert(2)">', 1.0, 2.0, [1, 1], [2, 2], 0),
                           PromptTau("plain", 1.5, 2.5, [1, 2], [2, 3], 0)])
    report.dynamic = DynamicAudit({"dflash": method}, [], 8, evil)
    html = render_html(report)
    assert "<script>alert(1)" not in html and "&lt;script&gt;alert(1)" in html
    assert "<img src=x" not in html and "&lt;img src=x" in html

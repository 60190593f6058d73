"""DSpark and XPress drafters written by speculators' own `save_pretrained`, in every mode of the tool: against
their own copy, their DFlash twin and a copy with one head setting changed; τ per prompt equal to speculators'
own model decoding (its modules chained as vLLM's runners chain them); their formats and `convert`."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from dflash_audit.audit.sides import load_side
from dflash_audit.audit.static import static_audit
from dflash_audit.cli import main
from dflash_audit.conversion import convert
from dflash_audit.formats import load_any
from impl.body_shapes import build_drafter
from impl.decoding import dflash_decode
from impl.offline import load_or_build_cache, offline_rounds
from tests.family_fixtures import family_spec, without_final_layer, world_backbone, write_speculators_drafter

FAMILIES = ("dspark", "xpress")
TITLE = {"dspark": "DSpark", "xpress": "XPress"}
# One changed head setting per family: the finding it must give.
CHANGED = {"dspark": ("markov_head_type", "gated", "dspark_heads"), "xpress": ("num_jacobi_passes", 1, "xpress_refiner")}
PROMPTS, MAX_NEW_TOKENS = 4, 64


@pytest.fixture(scope="module")
def written(test_world, tmp_path_factory):
    """Per family: its speculators directory, the DFlash twin (same body) and the changed-setting copy."""
    base, body = without_final_layer(*world_backbone(test_world))
    root = tmp_path_factory.mktemp("family")
    out = {}
    for family in FAMILIES:
        name, value, _ = CHANGED[family]
        spec = family_spec(base, family)
        out[family] = {
            "self": write_speculators_drafter(root / family, spec, body, test_world.target),
            "twin": write_speculators_drafter(root / f"{family}-twin", family_spec(base, "dflash",
                                              sample_from_anchor=spec.sample_from_anchor), body, test_world.target),
            "changed": write_speculators_drafter(root / f"{family}-changed", dataclasses.replace(spec, **{name: value}),
                                                 body, test_world.target),
        }
    return out


def divergences(result):
    return [f for f in result.findings if f.severity == "divergence"]


@pytest.mark.parametrize("family", FAMILIES)
def test_a_speculators_directory_loads_as_its_family_with_its_settings_and_provenance(written, test_world, family):
    loaded = load_any(written[family]["self"], test_world.target)
    config = json.loads((written[family]["self"] / "config.json").read_text())
    assert config["speculators_model_type"] == family
    assert loaded.spec.family == family
    own = {"dspark": ("markov_rank", "markov_head_type", "enable_confidence_head", "confidence_head_with_markov"),
           "xpress": ("xpress_rank", "xpress_mlp_ratio", "num_jacobi_passes")}[family]
    for name in own:
        assert getattr(loaded.spec, name) == config[name]
        assert loaded.provenance[name].source == "declared"


@pytest.mark.parametrize("family", FAMILIES)
def test_against_its_own_copy_it_is_clean_with_tau_measured(written, test_world, family, tmp_path, capsys):
    path = written[family]["self"]
    assert main(["compare", "--ours", str(path), "--ref", str(path), "--target", str(test_world.target),
                 "--max-new-tokens", "32", "--out", str(tmp_path / "r"), "--cache-dir", str(tmp_path / "c")]) == 0
    report = json.loads((tmp_path / "r" / "report.json").read_text())
    assert [f for f in report["findings"] if f["severity"] == "divergence"] == []
    prompts = report["tau"]["prompts"] if isinstance(report["tau"], dict) else report["tau"][0]["prompts"]
    assert prompts and all(p["ours"] == p["ref"] for p in prompts)


@pytest.mark.parametrize("family", FAMILIES)
def test_against_its_dflash_twin_one_architecture_divergence_names_the_family(written, test_world, family):
    result = static_audit(load_side(written[family]["self"], test_world.target),
                          load_side(written[family]["twin"], test_world.target))
    found = divergences(result)
    assert [(f.component, f.key) for f in found] == [("architecture", "family")]
    assert TITLE[family] in found[0].message and "DFlash" in found[0].message
    head_rows = [row for row in result.tensor_rows if row.key.startswith(("markov_head.", "confidence_head.",
                                                                      "refiner_head."))]
    assert head_rows and all(row.explained_by == "architecture" for row in head_rows)  # every tensor accounted for


@pytest.mark.parametrize("family", FAMILIES)
def test_against_a_copy_with_another_head_setting_that_setting_diverges(written, test_world, family):
    name, value, component = CHANGED[family]
    result = static_audit(load_side(written[family]["self"], test_world.target),
                          load_side(written[family]["changed"], test_world.target))
    found = divergences(result)
    assert [(f.component, f.key) for f in found] == [(component, name)]
    assert found[0].ref == value


@pytest.mark.parametrize("family", FAMILIES)
def test_convert_to_ours_and_back_is_exact_and_zlab_is_refused(written, test_world, family, tmp_path, capsys):
    source = written[family]["self"]
    convert(source, tmp_path / "ours.pt", "ours", target=test_world.target)
    convert(tmp_path / "ours.pt", tmp_path / "back", "speculators", target=test_world.target)
    before, middle, after = (load_any(p, test_world.target) for p in (source, tmp_path / "ours.pt", tmp_path / "back"))
    assert before.spec == middle.spec == after.spec
    assert before.state_dict.keys() == middle.state_dict.keys() == after.state_dict.keys()
    for key, tensor in before.state_dict.items():
        assert torch.equal(tensor, middle.state_dict[key]) and torch.equal(tensor, after.state_dict[key]), key
    capsys.readouterr()  # what the conversions above printed (speculators' save_pretrained progress)
    code = main(["convert", "--from", str(source), "--to", str(tmp_path / "zlab"), "--format", "zlab"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "z-lab" in err[0] and TITLE[family] in err[0]
    assert not (tmp_path / "zlab").exists()


@pytest.mark.dynamic
@pytest.mark.parametrize("family,overrides", [("dspark", {}), ("dspark", {"markov_head_type": "rnn"}),
                                              ("xpress", {}), ("xpress", {"num_jacobi_passes": 0})])
def test_tau_per_prompt_equals_speculators_own_model_live_and_offline(test_world, trained_pair, tmp_path, family,
                                                                       overrides):
    from reference_adapters.speculators_adapter import load_speculators_model
    from reference_adapters.speculators_family_decode import speculators_rounds

    _, target, prompts, stops = trained_pair
    base, body = world_backbone(test_world)
    path = write_speculators_drafter(tmp_path / family, family_spec(base, family, **overrides), body,
                                     test_world.target)
    loaded = load_any(path, test_world.target)
    ours = build_drafter(loaded.spec, loaded.state_dict).to(next(target.parameters()).dtype).eval()
    reference = load_speculators_model(path, test_world.target).to(next(target.parameters()).dtype)
    cache = load_or_build_cache(tmp_path / "cache", test_world.target, target, prompts[:PROMPTS], MAX_NEW_TOKENS, stops)
    taus = []
    for entry, (prompt_id, ids) in zip(cache.prompts, prompts[:PROMPTS]):
        live = dflash_decode(ours, target, ids, MAX_NEW_TOKENS, stops)
        offline = offline_rounds(ours, target, cache, entry)
        theirs, theirs_ids = speculators_rounds(reference, target, ids, MAX_NEW_TOKENS, stops)
        assert live.acceptance_lengths == theirs, f"prompt {prompt_id}: live rounds vs speculators' own model"
        assert offline == theirs, f"prompt {prompt_id}: offline rounds vs speculators' own model"
        assert live.output_ids[0].tolist() == theirs_ids
        taus.append(sum(theirs) / len(theirs))
    assert max(taus) > 1.5, f"the drafter accepts too little to test decoding: {taus}"

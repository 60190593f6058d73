"""DSpark and XPress drafters written by speculators' own `save_pretrained`, in every mode of the tool: against
their own copy, their DFlash twin and a copy with one head setting changed; τ per prompt equal to speculators'
own model decoding (its modules chained as vLLM's runners chain them); their formats and `convert`."""

from __future__ import annotations

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
            "changed": write_speculators_drafter(root / f"{family}-changed", spec.replace(**{name: value}),
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


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    """The offline cache's folder for the τ tests below: the target's hidden states on their prompts are the same
    whatever the drafter, built by the first test and read by the others."""
    return tmp_path_factory.mktemp("family-cache")


@pytest.mark.dynamic
@pytest.mark.parametrize("family,overrides", [("dspark", {}), ("dspark", {"markov_head_type": "rnn"}),
                                              ("xpress", {}), ("xpress", {"num_jacobi_passes": 0})])
def test_tau_per_prompt_equals_speculators_own_model_live_and_offline(test_world, trained_pair, tmp_path, cache_dir,
                                                                       family, overrides):
    from reference_adapters.speculators_adapter import load_speculators_model
    from reference_adapters.speculators_family_decode import speculators_rounds

    _, target, prompts, stops = trained_pair
    base, body = world_backbone(test_world)
    path = write_speculators_drafter(tmp_path / family, family_spec(base, family, **overrides), body,
                                     test_world.target)
    loaded = load_any(path, test_world.target)
    ours = build_drafter(loaded.spec, loaded.state_dict).to(next(target.parameters()).dtype).eval()
    reference = load_speculators_model(path, test_world.target).to(next(target.parameters()).dtype)
    cache = load_or_build_cache(cache_dir, test_world.target, target, prompts[:PROMPTS], MAX_NEW_TOKENS, stops)
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


def serve_check(path, target, tmp_path, name) -> tuple[int, dict]:
    out = tmp_path / f"{name}.json"
    code = main(["serve-check", "--drafter", str(path), "--engine", "vllm,sglang", "--target", str(target),
                 "--json", str(out)])
    return code, json.loads(out.read_text())["serving"]


def divergent(report: dict) -> dict[str, dict]:
    return {f["field"]: f for f in report["findings"] if f["severity"] == "divergence"}


def test_serve_check_dspark_vllm_serves_the_vanilla_markov_head_only(written, test_world, tmp_path):
    """speculators' DSpark through vLLM 0.33.0's own code: the vanilla head serves as trained (its runner's fill-in
    layout, K = 7, method dspark on the V2 runner); a gated or rnn head is refused over that head's tensors, one
    finding; SGLang reads no speculators directory."""
    code, serving = serve_check(written["dspark"]["self"], test_world.target, tmp_path, "vanilla")
    vllm, sglang = serving["vllm"], serving["sglang"]
    assert code == 1 and divergent(vllm) == {} and list(divergent(sglang)) == ["loads"]
    assert vllm["loads"] and vllm["served"]["markov_head_type"] == "vanilla" and vllm["served"]["markov_rank"] == 16
    assert (vllm["served"]["block_size"], vllm["served"]["num_speculative_tokens"]) == (8, 7)
    assert vllm["command"].startswith("VLLM_USE_V2_MODEL_RUNNER=1 vllm serve ") and '"method": "dspark"' in vllm["command"]
    assert any("--speculative-algorithm DSPARK" in note for note in sglang["notes"])
    base, body = without_final_layer(*world_backbone(test_world))
    rnn = write_speculators_drafter(tmp_path / "rnn", family_spec(base, "dspark", markov_head_type="rnn"), body,
                                    test_world.target)
    for head, path in (("gated", written["dspark"]["changed"]), ("rnn", rnn)):
        code, serving = serve_check(path, test_world.target, tmp_path, head)
        found = divergent(serving["vllm"])
        assert code == 1 and list(found) == ["markov_head_type"] and not serving["vllm"]["loads"]
        assert (found["markov_head_type"]["trained"], found["markov_head_type"]["served"]) == (head, "vanilla")
        extra = {"gated": "gate_proj", "rnn": "joint_proj"}[head]
        assert serving["vllm"]["served"]["tensors_refused"] == [f"markov_head.{extra}.bias",
                                                                f"markov_head.{extra}.weight"]
        assert f"markov_head.{extra}.weight" in found["markov_head_type"]["message"]


def test_serve_check_xpress_vllm_refuses_it_and_reads_other_names(written, test_world, tmp_path):
    """speculators' XPress: vLLM 0.33.0 translates no `xpress` config; its XPress files read `xpress_head.*`,
    `xpress_num_passes`, `xpress_mlp_hidden` where speculators writes `refiner_head.*`, `num_jacobi_passes`,
    `xpress_mlp_ratio`, so their defaults would run; slot 0's refiner predecessor is the anchor itself."""
    from safetensors import safe_open

    path = written["xpress"]["self"]
    code, serving = serve_check(path, test_world.target, tmp_path, "xpress")
    found = divergent(serving["vllm"])
    assert code == 1 and set(found) == {"loads", "tensors_refused", "num_jacobi_passes", "xpress_mlp_hidden",
                                        "refiner_block_size", "refiner_candidates", "refiner_slot0"}
    assert "'xpress'" in found["loads"]["message"] and "\n" not in found["loads"]["message"]
    names = [n for f in sorted(path.glob("*.safetensors")) for n in safe_open(str(f), "pt").keys()]
    assert found["tensors_refused"]["served"] == sorted(n for n in names if n.startswith("refiner_head."))
    expected = {"num_jacobi_passes": (3, 6), "xpress_mlp_hidden": (32, 512), "refiner_block_size": (8, 16),
                "refiner_candidates": (2048, 512), "refiner_slot0": ("the token before the anchor", "the anchor")}
    assert {name: (found[name]["trained"], found[name]["served"]) for name in expected} == expected
    assert list(divergent(serving["sglang"])) == ["loads"] and "no XPress" in serving["sglang"]["notes"][0]


def test_vllm_reads_none_of_the_names_speculators_writes_for_xpress():
    """Backs the XPress findings: no installed vLLM file reads speculators' XPress names; its XPress files read
    their own."""
    from serving_engines.source_exec import installed_file

    root = installed_file("vllm.config.speculative").parents[1]
    text = "\n".join(p.read_text(encoding="utf-8", errors="replace") for part in ("model_executor", "v1", "config",
                                                                             "transformers_utils")
                     for p in (root / part).rglob("*.py"))
    for written_by_speculators in ('"num_jacobi_passes"', '"xpress_mlp_ratio"', "refiner_head", '"xpress"'):
        assert written_by_speculators not in text, written_by_speculators
    for read_by_vllm in ('"xpress_num_passes"', '"xpress_mlp_hidden"', '"xpress_head."'):
        assert read_by_vllm in text, read_by_vllm


def test_convert_for_vllm_writes_dspark_as_speculators_and_refuses_what_no_format_serves(written, test_world, tmp_path,
                                                                                         capsys):
    """vLLM serves DSpark from speculators' own config (z-lab has no DSpark): `convert --for vllm` writes that,
    checked by serve-check; a gated head, XPress and SGLang are refused in one line before anything is written."""
    target = str(test_world.target)
    convert(written["dspark"]["self"], tmp_path / "ours.pt", "ours", target=test_world.target)
    assert main(["convert", "--from", str(tmp_path / "ours.pt"), "--to", str(tmp_path / "v"), "--for", "vllm",
                 "--target", target]) == 0
    assert json.loads((tmp_path / "v" / "config.json").read_text())["speculators_model_type"] == "dspark"
    assert main(["serve-check", "--drafter", str(tmp_path / "v"), "--engine", "vllm", "--target", target]) == 0
    capsys.readouterr()
    for source, engine, words in ((written["dspark"]["changed"], "vllm", "markov_head_type = 'gated'"),
                                  (written["xpress"]["self"], "vllm", "slot 0 the anchor itself"),
                                  (written["dspark"]["self"], "sglang", "SGLang 0.5.23's DSPARK")):
        out = tmp_path / f"refused-{engine}"
        assert main(["convert", "--from", str(source), "--to", str(out), "--for", engine, "--target", target]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and words in err[0] and not out.exists()


def test_vllm_translates_a_speculators_dspark_config_to_its_qwen3_model_only():
    """vLLM's own `update_dspark`: a speculators DSpark config becomes Qwen3DSparkModel whatever architecture it
    names (gemma4_dspark.py never reads one), keeps sample_from_anchor and drops sliding_window_non_causal (no
    dflash_config: each layer then runs causal exactly when it slides, qwen3_dflash.py `_dflash_layer_causal`)."""
    from vllm.transformers_utils.configs.speculators.algos import update_dspark

    for architectures in ([], ["DSparkDraftModel"], ["Gemma4DSparkModel"]):
        translated = {}
        update_dspark({"architectures": architectures, "aux_hidden_state_layer_ids": [2, 4], "markov_rank": 8,
                       "sample_from_anchor": True, "sliding_window_non_causal": True}, translated)
        assert translated["architectures"] == ["Qwen3DSparkModel"]
        assert translated["target_layer_ids"] == [1, 3] and translated["sample_from_anchor"] is True
        assert "dflash_config" not in translated and "sliding_window_non_causal" not in translated

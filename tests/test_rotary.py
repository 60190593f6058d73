"""Rotary settings (#35): the spec's fields, how each format reads and writes them with provenance, our
drafter's partial rotary, and the static `rotary` finding (drafter vs drafter, drafter vs its reference)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from dflash_audit.audit.sides import load_side
from dflash_audit.audit.static import static_audit
from dflash_audit.cli import main
from dflash_audit.formats.speculators import zlab_shaped_config
from drafter_files.checkpoint import save_checkpoint
from impl.model import DFlashDrafter
from impl.spec import SpecError
from drafter_files.zlab_format import save_zlab_dir, spec_from_zlab_config, zlab_config
from tests.helpers import tiny_spec

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 10240}


def drafter(**overrides) -> DFlashDrafter:
    torch.manual_seed(0)
    return DFlashDrafter(tiny_spec(**overrides))


def rotary_findings(result):
    return sorted((f.key, f.severity) for f in result.findings if f.component == "rotary")


def test_spec_validates_rotary_settings():
    with pytest.raises(SpecError, match="partial_rotary_factor"):
        tiny_spec(partial_rotary_factor=1.5)
    with pytest.raises(SpecError, match="partial_rotary_factor"):
        tiny_spec(partial_rotary_factor=0.1)  # 16 * 0.1 = 1 dim: rotary pairs dims
    with pytest.raises(SpecError, match="rope_scaling"):
        tiny_spec(rope_scaling={"rope_type": "no-such-scaling"})
    with pytest.raises(SpecError, match="rope_style"):
        tiny_spec(rope_style="sideways")
    spec = tiny_spec(rope_scaling=dict(YARN), partial_rotary_factor=0.5)
    unscaled = tiny_spec(partial_rotary_factor=0.5)
    assert spec.rotary_dim == 8 and hash(spec) == hash(unscaled) and spec != unscaled  # the dict: compared, not hashed


def test_partial_rotary_passes_the_last_dims_through():
    spec = tiny_spec(partial_rotary_factor=0.25)
    model = drafter(partial_rotary_factor=0.25)
    x = torch.randn(1, 2, 5, spec.head_dim)
    from impl.model import rotate
    rotated = rotate(x, *model.rotary_emb(x, torch.arange(3, 8)[None]))
    assert torch.equal(rotated[..., 4:], x[..., 4:]) and not torch.allclose(rotated[..., :4], x[..., :4])


def test_interleaved_style_is_ours_and_audited_against_the_reference_it_is_written_for(tmp_path):
    interleaved = drafter(rope_style="gptj")  # held to transformers' GPT-J rotary in conformance/test_rotary.py
    x = torch.randn(1, 2, 3, 16)
    from impl.model import rotate
    cos, sin = interleaved.rotary_emb(x, torch.arange(3)[None])
    assert torch.equal(cos[..., 0::2], cos[..., 1::2])  # one frequency per pair of dims
    neox = rotate(x, *drafter().rotary_emb(x, torch.arange(3)[None]))
    assert not torch.allclose(rotate(x, cos, sin, interleaved=True), neox)
    save_zlab_dir(tmp_path / "gptj", interleaved.spec, interleaved.state_dict())
    save_checkpoint(tmp_path / "neox.pt", drafter())
    result = static_audit(load_side(tmp_path / "neox.pt"), load_side(tmp_path / "gptj"))
    assert rotary_findings(result) == [("rope_style applied in ref", "divergence")]  # z-lab runs it neox


def test_zlab_format_round_trip_and_provenance(tmp_path):
    model = drafter(rope_theta=500_000.0, rope_scaling=dict(YARN), partial_rotary_factor=0.5)
    save_zlab_dir(tmp_path / "z", model.spec, model.state_dict())
    side = load_side(tmp_path / "z")
    assert side.spec == model.spec
    assert {name: side.provenance[name]["source"] for name in ("rope_theta", "rope_scaling", "partial_rotary_factor",
                                                               "rope_style")} == \
        {"rope_theta": "declared", "rope_scaling": "declared", "partial_rotary_factor": "declared",
         "rope_style": "default"}
    # gptj is written the engines' way, and read back
    config = zlab_config(dataclasses.replace(model.spec, rope_style="gptj"))
    assert config["is_neox_style"] is False and spec_from_zlab_config(config).rope_style == "gptj"


def test_rotary_read_as_transformers_reads_it():
    config = zlab_config(tiny_spec())
    del config["rope_parameters"]
    # the pre-5 spellings: rope_scaling with `type`, top-level theta and partial factor
    config.update(rope_scaling={"type": "linear", "factor": 2.0}, rope_theta=5e5, partial_rotary_factor=0.5)
    spec = spec_from_zlab_config(config)
    assert (spec.rope_theta, spec.rope_scaling, spec.partial_rotary_factor) == \
        (5e5, {"rope_type": "linear", "factor": 2.0}, 0.5)


def test_speculators_layer_config_carries_rotary():
    layer = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
             "head_dim": 16, "num_hidden_layers": 1, "vocab_size": 128,
             "rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.25}}
    config = {"speculators_model_type": "dflash", "transformer_layer_config": layer, "aux_hidden_state_layer_ids": [2],
              "mask_token_id": 5, "is_neox_style": True}
    spec = spec_from_zlab_config(zlab_shaped_config(config, 4, "config.json"))
    assert (spec.partial_rotary_factor, spec.rope_scaling, spec.rope_style) == (0.25, None, "neox")


def test_inherited_partial_factor_is_one_finding_on_that_side(tmp_path):
    """A z-lab config declaring a factor its reference's default rope ignores: one finding, and no second
    one against a drafter that rotates every dim (both rotate the same dims under the references)."""
    inherited, plain = drafter(partial_rotary_factor=0.25), drafter()
    save_zlab_dir(tmp_path / "inherited", inherited.spec, inherited.state_dict())
    save_checkpoint(tmp_path / "plain.pt", plain)
    result = static_audit(load_side(tmp_path / "plain.pt"), load_side(tmp_path / "inherited"))
    assert rotary_findings(result) == [("partial_rotary_factor applied in ref", "divergence")]
    (finding,) = [f for f in result.findings if f.component == "rotary"]
    assert finding.pitfall == 35 and "#30" in finding.message and "every head dim is rotated" in finding.message


def test_compare_cli_partial_factor_only_is_one_rotary_finding(tmp_path):
    partial, full = drafter(partial_rotary_factor=0.5), drafter()
    for name, model in (("partial.pt", partial), ("partial_again.pt", partial), ("full.pt", full)):
        save_checkpoint(tmp_path / name, model)
    out = tmp_path / "out"
    assert main(["compare", "--ours", str(tmp_path / "partial.pt"), "--ref", str(tmp_path / "full.pt"),
                 "--out", str(out)]) == 1
    findings = json.loads((out / "report.json").read_text())["findings"]
    assert [(f["component"], f["key"], f["pitfall"]) for f in findings] == [("rotary", "partial_rotary_factor", 35)]
    assert main(["compare", "--ours", str(tmp_path / "partial.pt"), "--ref", str(tmp_path / "partial_again.pt"),
                 "--out", str(out)]) == 0
    assert [f for f in json.loads((out / "report.json").read_text())["findings"] if f["component"] == "rotary"] == []


def test_speculators_format_written_by_speculators_keeps_rotary(tmp_path, target_dir):
    """speculators' own save_pretrained writes the settings into transformer_layer_config; read back, a scaling
    survives the round trip and an inherited factor is the one finding on that side."""
    from dflash_audit.conversion import convert

    scaled = drafter(rope_theta=500_000.0, rope_scaling=dict(YARN))
    save_zlab_dir(tmp_path / "scaled", scaled.spec, scaled.state_dict())
    convert(tmp_path / "scaled", tmp_path / "scaled-spec", "speculators", target=target_dir)
    side = load_side(tmp_path / "scaled-spec")
    assert side.format == "speculators" and side.spec == scaled.spec
    assert side.provenance["rope_scaling"]["source"] == "declared"

    inherited = drafter(partial_rotary_factor=0.25)
    save_zlab_dir(tmp_path / "inherited", inherited.spec, inherited.state_dict())
    convert(tmp_path / "inherited", tmp_path / "inherited-spec", "speculators", target=target_dir)
    save_checkpoint(tmp_path / "plain.pt", drafter())
    result = static_audit(load_side(tmp_path / "plain.pt"), load_side(tmp_path / "inherited-spec"))
    assert rotary_findings(result) == [("partial_rotary_factor applied in ref", "divergence")]
    assert "train/cli.py" in next(f.message for f in result.findings if f.component == "rotary")


def test_checkpoint_written_before_the_fields_reads_as_our_defaults(tmp_path):
    save_checkpoint(tmp_path / "old.pt", drafter())
    payload = torch.load(tmp_path / "old.pt", weights_only=True)
    for name in ("rope_scaling", "partial_rotary_factor", "rope_style"):
        del payload["spec"][name]
    torch.save(payload, tmp_path / "old.pt")
    side = load_side(tmp_path / "old.pt")
    assert side.spec == tiny_spec()
    assert [side.provenance[name]["source"] for name in ("rope_theta", "rope_scaling", "partial_rotary_factor",
                                                         "rope_style")] == ["declared", "default", "default", "default"]


def test_interleaved_style_survives_conversion_to_speculators(tmp_path, target_dir):
    from dflash_audit.conversion import convert

    interleaved = drafter(rope_style="gptj")
    save_zlab_dir(tmp_path / "gptj", interleaved.spec, interleaved.state_dict())
    convert(tmp_path / "gptj", tmp_path / "gptj-spec", "speculators", target=target_dir)
    side = load_side(tmp_path / "gptj-spec")
    assert side.spec.rope_style == "gptj" and side.provenance["rope_style"]["source"] == "declared"


def test_a_partial_drafter_is_written_so_both_engines_serve_its_factor(tmp_path, target_dir):
    """rope_parameters for vLLM, the top-level field for SGLang (#30): `convert --for` proves each through the
    engine's own rule."""
    save_checkpoint(tmp_path / "partial.pt", drafter(partial_rotary_factor=0.5))
    for engine in ("vllm", "sglang"):
        assert main(["convert", "--from", str(tmp_path / "partial.pt"), "--to", str(tmp_path / engine),
                     "--for", engine, "--target", str(target_dir)]) == 0


def test_foreign_checkpoint_declaring_a_rope_dict(tmp_path):
    """A team's args with a rope dict (old spelling) and a top-level factor: read as transformers reads them."""
    spec = tiny_spec(layer_types=("full_attention",) * 3, sliding_window=None)
    model = DFlashDrafter(spec)
    torch.save(model.state_dict(), tmp_path / "drafter.pt")
    args = {"fc_layers": [1, 3, 4], "target_num_layers": 6, "mask_id": 127, "block_size": 8, "vocab_size": 128,
            "rope_scaling": {"type": "linear", "factor": 2.0}, "partial_rotary_factor": 0.5}
    (tmp_path / "args.json").write_text(json.dumps(args))
    side = load_side(tmp_path / "drafter.pt")
    assert side.format == "foreign"
    assert (side.spec.rope_scaling, side.spec.partial_rotary_factor, side.spec.rope_style) == \
        ({"rope_type": "linear", "factor": 2.0}, 0.5, "neox")
    assert [side.provenance[name]["source"] for name in ("rope_scaling", "partial_rotary_factor", "rope_style")] == \
        ["declared", "declared", "default"]


def test_a_zlab_config_without_rope_reads_the_theta_zlab_runs(tmp_path):
    from reference_adapters.zlab_adapter import load_zlab_model

    model = drafter()
    save_zlab_dir(tmp_path / "z", model.spec, model.state_dict())
    config = json.loads((tmp_path / "z" / "config.json").read_text())
    del config["rope_parameters"]
    (tmp_path / "z" / "config.json").write_text(json.dumps(config))
    side = load_side(tmp_path / "z")
    assert side.spec.rope_theta == load_zlab_model(tmp_path / "z").config.rope_parameters["rope_theta"] == 10_000.0
    provenance = side.provenance["rope_theta"]
    assert provenance["source"] == "default" and "Qwen3Config" in provenance["detail"]


def test_twins_inheriting_one_factor_are_one_finding(tmp_path, target_dir):
    """A z-lab directory and its speculators twin (written by speculators' own save_pretrained) declaring the
    same inherited factor: one root cause, one finding naming both references."""
    from dflash_audit.conversion import convert

    twin = drafter(partial_rotary_factor=0.25)
    save_zlab_dir(tmp_path / "zlab", twin.spec, twin.state_dict())
    convert(tmp_path / "zlab", tmp_path / "spec", "speculators", target=target_dir)
    result = static_audit(load_side(tmp_path / "spec"), load_side(tmp_path / "zlab"), expect_identical=True)
    assert rotary_findings(result) == [("partial_rotary_factor applied in ours and ref", "divergence")]
    assert [f.component for f in result.findings if f.severity == "divergence"] == ["rotary"]
    message = next(f.message for f in result.findings if f.component == "rotary")
    assert "speculators 0.9.0" in message and "z-lab's DFlashDraftModel" in message

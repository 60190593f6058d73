"""The README's opening story, end to end: a team's own training checkpoint of a Qwen3.6-27B DFlash drafter.

Their file: their own parameter names, fc over 4 of the 5 target layers (layer 61 left
out), targets from layer 61 of 64, loss decay gamma 7, saved as
`{"model_state_dict", "optimizer_state_dict", "args": Namespace(...)}`. Against a z-lab
reference of that config the audit must say exactly `fc_dims` (naming layer 61) and
`recipe` (gamma, target source layer) — the fc width follows from the layer selection, so
it is one finding, not two. The spec is checked at the real dimensions on the meta device;
the files are written at scaled-down width (same layer counts, heads and ids).
"""

from __future__ import annotations

import argparse
import json
import pathlib

import torch

from dflash_audit.audit.sides import Side
from dflash_audit.audit.static_recipe import recipe_findings
from dflash_audit.audit.static_spec import layer_id_findings, spec_findings
from dflash_audit.cli import main
from dflash_audit.formats.shape_inference import infer
from dflash_audit.formats.key_map import map_names, propose_key_map, read_key_map
from impl.model import DFlashDrafter
from impl.spec import DraftSpec
from drafter_files.zlab_format import save_zlab_dir

# Qwen3.6-27B-DFlash (z-lab): the published drafter's dimensions.
REAL = DraftSpec(hidden_size=5120, intermediate_size=17408, num_attention_heads=32, num_key_value_heads=8,
                 head_dim=128, num_hidden_layers=5, target_vocab_size=248320, target_layer_ids=(1, 16, 31, 46, 61),
                 num_target_layers=64, mask_token_id=248070, block_size=16)
TEAM_RENAME = {"self_attn.q_proj": "attn.wq", "self_attn.k_proj": "attn.wk", "self_attn.v_proj": "attn.wv",
               "self_attn.o_proj": "attn.wo", "self_attn.q_norm": "attn.q_norm", "self_attn.k_norm": "attn.k_norm",
               "mlp.gate_proj": "mlp.w1", "mlp.up_proj": "mlp.w3", "mlp.down_proj": "mlp.w2",
               "input_layernorm": "attn_norm", "post_attention_layernorm": "mlp_norm"}
TEAM_TOP = {"fc.weight": "fc_proj.weight", "hidden_norm.weight": "ctx_norm.weight", "norm.weight": "final_norm.weight"}
TEAM_ARGS = dict(target_model="/models/Qwen3.6-27B", target_layers=[1, 16, 31, 46], target_layer=61, gamma=7.0,
                 block_size=16, num_draft_layers=5, mask_token_id=248070, lr=6e-4, epochs=3, seed=42)


def team_name(key: str) -> str:
    if key in TEAM_TOP:
        return TEAM_TOP[key]
    _, index, rest = key.split(".", 2)
    for canonical, theirs in TEAM_RENAME.items():
        rest = rest.replace(canonical, theirs)
    return f"blocks.{index}.{rest}"


def team_spec(spec: DraftSpec) -> DraftSpec:
    return spec.replace(target_layer_ids=(1, 16, 31, 46))  # layer 61 kept for the loss only


def test_the_real_shape_is_read_from_the_team_names_on_the_meta_device(tmp_path):
    with torch.device("meta"):
        team = DFlashDrafter(team_spec(REAL))
    shapes = {team_name(k): tuple(v.shape) for k, v in team.state_dict().items()}
    assert shapes["fc_proj.weight"] == (5120, 4 * 5120)
    (tmp_path / "map.txt").write_text(propose_key_map(shapes))
    mapping = map_names(list(shapes), read_key_map(tmp_path / "map.txt"))
    assert not mapping.unmapped and set(mapping.renamed.values()) == set(team.state_dict())
    canonical = {mapping.renamed[k]: v for k, v in shapes.items()}
    inference = infer(canonical, [("ckpt.pt: args", TEAM_ARGS)], None, "", {}, "--ours-spec")
    expected = {"hidden_size": 5120, "num_hidden_layers": 5, "num_attention_heads": 32, "num_key_value_heads": 8,
                "head_dim": 128, "intermediate_size": 17408}
    assert {k: inference.values[k] for k in expected} == expected
    assert all(inference.provenance[k].source == "inferred" for k in expected)
    assert inference.fc_layer_count == 4 and inference.values["target_layer_ids"] == [1, 16, 31, 46]
    assert inference.recipe_values == {"gamma": 7.0, "verifier_source_layer": 61}

    # The root-cause findings at the real dimensions (no tensor values involved).
    with torch.device("meta"):
        ref_tensors = DFlashDrafter(REAL).state_dict()
    body = {mapping.renamed[team_name(k)]: v for k, v in team.state_dict().items()}
    ours = Side("ckpt.pt", "foreign", None, body, inference.recipe(), [1, 16, 31, 46], "zlab",
                known=dict(inference.values), provenance={k: p.to_dict() for k, p in inference.provenance.items()},
                recipe_unknown=inference.recipe_unknown)
    ref = Side("zlab", "zlab", REAL, dict(ref_tensors), None, list(REAL.target_layer_ids), "zlab")
    fc = layer_id_findings(ours, ref)
    assert [f.component for f in fc] == ["fc_dims"] and "leaves out target layer 61 (the deepest)" in fc[0].message
    assert "in_features 20480 vs 25600" in fc[0].message
    assert [f.component for f in spec_findings(ours, ref) if f.severity == "divergence"] == ["fc_dims"]
    recipe, _ = recipe_findings(ours, ref)
    assert sorted(f.key for f in recipe) == ["gamma", "verifier_source_layer"]


def test_the_team_checkpoint_audits_to_exactly_fc_dims_and_recipe(tmp_path, capsys):
    # Scaled-down width, real structure: 5 layers, 32 heads of 128, 8 kv heads, 64 target layers, block 16.
    scaled = REAL.replace(hidden_size=160, intermediate_size=544)
    torch.manual_seed(0)
    reference = DFlashDrafter(scaled)
    save_zlab_dir(tmp_path / "zlab", scaled, reference.state_dict())
    torch.manual_seed(1)
    team = DFlashDrafter(team_spec(scaled))
    optimizer = torch.optim.AdamW(team.parameters(), lr=6e-4)
    args = argparse.Namespace(**TEAM_ARGS, output_dir=pathlib.Path("/ckpts/run7"))
    torch.save({"model_state_dict": {team_name(k): v for k, v in team.state_dict().items()},
                "optimizer_state_dict": optimizer.state_dict(), "args": args, "epoch": 3}, tmp_path / "ckpt.pt")
    command = ["compare", "--ours", str(tmp_path / "ckpt.pt"), "--ref", str(tmp_path / "zlab"), "--static-only",
               "--out", str(tmp_path / "report")]

    # Their names match no known scheme: a map is proposed on stdout, nothing applied.
    assert main(command) == 2
    proposal = capsys.readouterr().out
    (tmp_path / "keymap.txt").write_text(proposal)
    assert main(command + ["--key-map", str(tmp_path / "keymap.txt")]) == 1

    report = json.loads((tmp_path / "report" / "report.json").read_text())
    divergences = sorted((f["component"], f["key"]) for f in report["findings"] if f["severity"] == "divergence")
    assert divergences == [("fc_dims", ""), ("recipe", "gamma"), ("recipe", "verifier_source_layer")]
    fc = next(f for f in report["findings"] if f["component"] == "fc_dims")
    assert "leaves out target layer 61 (the deepest)" in fc["message"] and fc["pitfall"] == 4
    fc_row = next(r for r in report["tensors"] if r["key"] == "fc.weight")
    assert fc_row["status"] == "shape" and fc_row["explained_by"] == "fc_dims"  # not again under weights
    gamma = next(f for f in report["findings"] if f["key"] == "gamma")
    # The team never said which loss or weighting it used: that decides nothing about the yardstick.
    assert "declares neither per_position_loss_weight nor loss_fn" in gamma["message"]
    provenance = report["ours"]["provenance"]
    assert provenance["target_layer_ids"] == {"source": "declared", "detail": "ckpt.pt: args.target_layers"}
    assert provenance["recipe.gamma"] == {"source": "declared", "detail": "ckpt.pt: args.gamma"}
    assert provenance["num_attention_heads"]["source"] == "inferred"
    assert report["ours"]["foreign"]["ignored_entries"] == {"optimizer_state_dict": "optimizer state"}
    assert report["ours"]["foreign"]["unrecognized_keys"]["ckpt.pt: args.output_dir"] == "/ckpts/run7"

"""Drafters saved by SpecForge 0.2.0 load in `compare`, `convert` and `eval`.

SpecForge's trainer writes `{run_id}-step{N}/training_state.pt` (its `CheckpointManager.save`; the
weights under `draft_state_dict`, beside step counters and the optimizer) and exports an HF
directory with `specforge.export.to_hf.export_to_hf` (z-lab's layout: `config.json` with
`dflash_config`, `model.safetensors`). The first is a foreign checkpoint (its spec comes from flags:
SpecForge keeps the draft config in a separate file), the second reads as z-lab's format. Both are
made here by SpecForge's own code from the test world's trained drafter, and must audit as that drafter.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import held.specforge  # noqa: F401 -- `make setup` installs SpecForge: missing, this fails, never skips
from dflash_audit.cli import main
from drafter_files.zlab_format import save_zlab_dir, zlab_config
from tests.helpers import load_trained_pair


@pytest.fixture(scope="module")
def saved(test_world, tmp_path_factory):
    """(training_state.pt, exported HF dir, z-lab dir of the same weights, spec flags, prompts file).

    SpecForge keeps the draft config beside the run, not in training_state.pt: every field the
    weights cannot show (layer ids, mask token, block, layer types, window, rope) is given as a flag."""
    from specforge.export.to_hf import export_to_hf
    from specforge.training.checkpoint import CheckpointManager

    from held.specforge import SpecForgeImplementation

    drafter, _, _, _ = load_trained_pair(test_world)
    spec, root = drafter.spec, tmp_path_factory.mktemp("specforge")
    model = SpecForgeImplementation().build_drafter(spec, drafter.state_dict())
    optimizer = torch.optim.AdamW(model.parameters())
    # The payload SpecForge's controller hands its CheckpointManager (training/controller.py: save_checkpoint).
    state = {"draft_state_dict": model.state_dict(), "global_step": 1, "epoch": 0, "epoch_batch": 1,
             "epoch_samples": 1, "strategy": "dflash", "run_id": "run", "world_size": 1,
             "replicated_optimizer_state": optimizer.state_dict()}
    step_dir = Path(CheckpointManager(str(root / "out"), "run").save(
        state, 1, rank_state={"optimizer": None, "rng": {"torch": torch.get_rng_state()}}))
    (root / "draft_config.json").write_text(json.dumps(zlab_config(spec)))
    export_to_hf(str(step_dir), str(root / "draft_config.json"), str(root / "hf"))
    save_zlab_dir(root / "zlab", spec, drafter.state_dict())
    flags = [f"target_layer_ids={','.join(map(str, spec.target_layer_ids))}", f"mask_token_id={spec.mask_token_id}",
             f"block_size={spec.block_size}", f"num_target_layers={spec.num_target_layers}",
             f"layer_types={','.join(spec.layer_types)}", f"sliding_window={spec.sliding_window}",
             f"rope_theta={spec.rope_theta}", f"max_position_embeddings={spec.max_position_embeddings}"]
    prompts = root / "two.jsonl"
    prompts.write_text("\n".join(Path(test_world.prompts).read_text().splitlines()[:2]) + "\n")
    return step_dir / "training_state.pt", root / "hf", root / "zlab", flags, prompts


def cli(*args) -> int:
    return main([str(a) for a in args])


def test_exported_directory_audits_as_the_same_drafter(saved, test_world, tmp_path):
    _, hf, zlab, _, prompts = saved
    assert cli("compare", "--ours", hf, "--ref", zlab, "--target", test_world.target, "--prompts", prompts,
               "--max-new-tokens", 16, "--out", tmp_path / "report", "--cache-dir", tmp_path / "cache") == 0
    report = json.loads((tmp_path / "report" / "report.json").read_text())
    assert report["ours"]["format"] == "zlab" and report["tau"]["mean"]["ours"] == report["tau"]["mean"]["ref"]


def test_training_state_loads_as_a_foreign_checkpoint(saved, tmp_path):
    state, _, zlab, flags, _ = saved
    spec_flags = [arg for flag in flags for arg in ("--ours-spec", flag)]
    assert cli("compare", "--ours", state, "--ref", zlab, "--static-only", *spec_flags,
               "--out", tmp_path / "report") == 0
    report = json.loads((tmp_path / "report" / "report.json").read_text())
    assert report["ours"]["format"] == "foreign"


def test_training_state_converts_and_evaluates(saved, test_world, tmp_path):
    state, hf, zlab, flags, prompts = saved
    spec_flags = [arg for flag in flags for arg in ("--spec", flag)]
    assert cli("convert", "--from", state, "--to", tmp_path / "as-zlab", "--format", "zlab", *spec_flags,
               "--target", test_world.target) == 0
    converted = json.loads((tmp_path / "as-zlab" / "config.json").read_text())
    assert converted["dflash_config"] == json.loads((hf / "config.json").read_text())["dflash_config"]
    for drafter in (tmp_path / "as-zlab", hf, zlab):
        out = tmp_path / f"{drafter.name}.json"
        assert cli("eval", "--drafter", drafter, "--target", test_world.target, "--prompts", prompts,
                   "--max-new-tokens", 16, "--json", out, "--cache-dir", tmp_path / "cache") == 0
    # The same drafter, whichever way SpecForge saved it.
    results = [json.loads((tmp_path / f"{name}.json").read_text()) for name in ("as-zlab", "hf", "zlab")]
    assert results[0] == results[1] == results[2]

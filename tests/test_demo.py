"""A reduced-size demo world through the demo's own code path names exactly the planted divergences."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from dflash_audit.flags.demo import DemoFlags
from dflash_audit.demo import KEY_FILE, DemoConfig, demo_key, prepare_cache, run_demo
from dflash_world import TEST_TARGET
from foundation.errors import AuditError

REPO = Path(__file__).resolve().parents[1]

PLANTED = [("fc_dims", ""), ("recipe", "gamma"), ("recipe", "verifier_source_layer")]


def reduced_demo_cache(test_world, cache, **overrides) -> DemoConfig:
    """A demo cache holding the test world's trained target (standing in for the demo's larger one) and
    a reduced config it counts as built for; the drafters are trained by the demo itself."""
    shutil.copytree(test_world.target, cache / "target")
    shutil.copy(test_world.prompts, cache / "prompts.jsonl")
    config = DemoConfig(**{**dict(target_preset=dict(TEST_TARGET), draft_layers=1, target_layer_ids=[1, 2],
                                  seq_len=128, drafter_steps=30, corpus_bytes=300_000, max_new_tokens=24, budget=8),
                           **overrides})
    (cache / KEY_FILE).write_text(demo_key(config))
    return config


@pytest.mark.slow
def test_reduced_demo_names_exactly_the_planted_divergences(test_world, tmp_path):
    cache = tmp_path / "demo"
    config = reduced_demo_cache(test_world, cache)
    report = run_demo(DemoFlags(world_dir=cache, out=tmp_path / "report"), config=config)

    data = json.loads((tmp_path / "report" / "report.json").read_text())
    divergent = sorted((f["component"], f["key"]) for f in data["findings"]
                       if f["severity"] == "divergence" and f["component"] != "tau")
    assert divergent == PLANTED
    assert data["ours"]["format"] == "ours" and data["ref"]["format"] == "zlab"
    assert report.dynamic.methods["dflash"].measured and len(data["tau"]["prompts"]) > 0
    assert (tmp_path / "report" / "index.html").is_file()
    # --serve: will each drafter serve as trained? ours is a ckpt.pt no engine reads; ref a z-lab directory.
    assert {side: sorted(engines) for side, engines in data["serving"].items()} == {
        "ours": ["sglang", "vllm"], "ref": ["sglang", "vllm"]}
    for engine in ("vllm", "sglang"):  # ours: a step (convert --for), then the converted drafter's verdict
        ours = data["serving"]["ours"][engine]
        assert ours["step"].startswith("not an engine format") and f"--for {engine}" in ours["step"]
        assert ours["loads"] and not any(f["field"] == "loads" for f in ours["findings"])
    assert data["serving"]["ref"]["vllm"]["loads"] and data["serving"]["ref"]["vllm"]["step"] is None

    # A second run reuses every cached artefact: nothing is retrained.
    stamps = {p: p.stat().st_mtime_ns for p in (cache / "ours.pt", cache / "ref" / "model.safetensors")}
    run_demo(DemoFlags(world_dir=cache, out=tmp_path / "report"), config=config)
    assert all(p.stat().st_mtime_ns == stamp for p, stamp in stamps.items())


# Held faster in `make test`: the demo's path and its three planted bugs by test_reduced_demo_names_exactly_the_planted_divergences,
# DFlash2's own findings by tests/test_dflash2_formats.py (test_each_dflash2_setting_is_its_own_finding: window_direction;
# test_compare_a_trained_dflash2_drafter_with_its_zlab_twin_on_the_world: "ddtree not measured").
@pytest.mark.full
@pytest.mark.slow
def test_reduced_dflash2_demo_names_the_planted_divergences_and_its_own(test_world, tmp_path):
    """The second act: the same three bugs on a DFlash2 pair, plus sliding blocks trained causal."""
    cache = tmp_path / "demo-dflash2"
    config = reduced_demo_cache(test_world, cache, draft_layers=2, family="dflash2", sliding_window=32)
    run_demo(DemoFlags(world_dir=cache, out=tmp_path / "report"), config=config)

    data = json.loads((tmp_path / "report" / "report.json").read_text())
    divergent = sorted((f["component"], f["key"]) for f in data["findings"]
                       if f["severity"] == "divergence" and f["component"] != "tau")
    assert divergent == sorted(PLANTED + [("window_direction", "sliding_window_non_causal")])
    assert set(data["tau"]["methods"]) == {"dflash"}  # DDTree is not defined on DFlash2: said, not run
    assert any(f["key"] == "ddtree not measured" for f in data["findings"])


def test_an_unknown_demo_family_is_refused_before_anything_is_built(tmp_path):
    with pytest.raises(AuditError, match="^--family: must be dflash or dflash2, got 'dflash3'$"):
        run_demo(DemoFlags(world_dir=tmp_path / "cache", out=tmp_path / "report", family="dflash3"))
    assert not (tmp_path / "cache").exists()


def test_a_cache_built_for_another_config_is_emptied_first(tmp_path):
    cache = tmp_path / "demo"
    cache.mkdir()
    (cache / "ours.pt").write_bytes(b"stale")
    (cache / "notes.txt").write_text("mine")
    (cache / KEY_FILE).write_text(demo_key(DemoConfig(drafter_steps=401)) + "\n")  # built for another config
    config = DemoConfig()
    prepare_cache(cache, config)
    assert not (cache / "ours.pt").exists() and (cache / "notes.txt").exists()
    assert (cache / KEY_FILE).read_text().strip() == demo_key(config)

    (cache / "ours.pt").write_bytes(b"built for this config")
    prepare_cache(cache, DemoConfig())
    assert (cache / "ours.pt").exists()
    prepare_cache(cache, DemoConfig(drafter_steps=401))
    assert not (cache / "ours.pt").exists()
    assert (cache / KEY_FILE).read_text().strip() == demo_key(DemoConfig(drafter_steps=401))


@pytest.mark.parametrize("key", [None, "not a key"])
def test_a_folder_without_a_demo_key_is_never_emptied(tmp_path, key):
    cache = tmp_path / "mine"
    cache.mkdir()
    (cache / "ours.pt").write_bytes(b"someone's checkpoint")
    if key is not None:
        (cache / KEY_FILE).write_text(key)
    with pytest.raises(AuditError, match=f"--world-dir {cache}: a non-empty folder that is not a demo world"):
        prepare_cache(cache, DemoConfig())
    assert (cache / "ours.pt").read_bytes() == b"someone's checkpoint"


def test_the_demo_key_has_no_time_budget():
    assert "drafter_seconds" not in DemoConfig().model_dump()


def _demo_env() -> dict[str, str]:
    """`make demo`'s kernel pins (the Makefile's DEMO_ENV line, their one home)."""
    line = next(l for l in (REPO / "Makefile").read_text().splitlines() if l.startswith("DEMO_ENV"))
    return dict(item.split("=", 1) for item in line.split(":=", 1)[1].split())


_TRAIN_AT_THREADS = """
import sys, torch
from dflash_world import stdlib_corpus
from impl.train import train_drafter
for count in (1, 2):
    torch.set_num_threads(count)
    assert torch.get_num_threads() == count
    train_drafter(sys.argv[1], stdlib_corpus("train", max_bytes=60_000), f"{sys.argv[2]}/{count}.pt", steps=3,
                  block_size=4, draft_layers=1, target_layer_ids=[1, 2], seq_len=64, batch_size=2, max_anchors=8,
                  warmup=1, seed=0, loss_fn="kl_div", per_position_loss_weight="fixed-exp-decay")
"""


def test_the_same_training_at_any_thread_count(test_world, tmp_path):
    """The demo's figures do not depend on how many cores a machine has: under `make demo`'s kernel pins (the
    AVX2 code paths, MKL's strict reproducibility mode), a drafter trained with 1 and with 2 torch threads is the
    same bit for bit. Both trainings run in one process of their own, since the pins are read when the libraries
    load; the thread count is torch's to change between them."""
    import os
    import subprocess
    import sys

    import torch

    from drafter_files.checkpoint import load_checkpoint

    env = {**os.environ, **_demo_env(), "PYTHONPATH": str(REPO)}
    subprocess.run([sys.executable, "-c", _TRAIN_AT_THREADS, str(test_world.target), str(tmp_path)],
                   env=env, cwd=tmp_path, check=True, capture_output=True)
    weights = {count: load_checkpoint(tmp_path / f"{count}.pt").state_dict for count in (1, 2)}
    assert weights[1].keys() == weights[2].keys()
    for name, value in weights[1].items():
        assert torch.equal(value, weights[2][name]), name

"""`serve-check --engine llamacpp` (static) and `convert --for llamacpp`: the drafter read the way llama.cpp b11434
reads it, each rule cited at its line in the pinned tree (every rule file pinned by sha256)."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from dflash_audit.cli import main
from serving_engines.live.llamacpp_env import source_tree

pytestmark = pytest.mark.skipif(not (source_tree() / "convert_hf_to_gguf.py").is_file() and not os.environ.get("CI"),
                                reason="run `make setup` to unpack and build llama.cpp b11434")


def test_every_rule_file_is_the_pinned_one_and_every_rule_line_is_in_it():
    from serving_engines.llamacpp_engine import PINNED, RULES, check_tree, cite

    assert check_tree() == "b11434"
    assert {rule.path for rule in RULES} <= set(PINNED)
    for rule in RULES:
        assert re.fullmatch(rf"llama\.cpp/{re.escape(rule.path)}:\d+", cite(rule.path, rule.needle))


@pytest.fixture(scope="module")
def full_gguf(llamacpp_full_gguf, test_world):
    return llamacpp_full_gguf, test_world


def serve_check(tmp_path, drafter, target, *extra) -> tuple[int, dict]:
    out = tmp_path / "serving.json"
    code = main(["serve-check", "--drafter", str(drafter), "--engine", "llamacpp", "--target", str(target),
                 "--json", str(out), *extra])
    return code, json.loads(out.read_text())["serving"]["llamacpp"]


def by_field(report: dict) -> dict:
    return {f["field"]: f for f in report["findings"]}


def test_the_last_target_layer_is_a_capture_finding_and_the_command_is_the_full_line(full_gguf, tmp_path, capsys):
    drafter, world = full_gguf
    code, report = serve_check(tmp_path, drafter, world.target)
    assert code == 1
    found = by_field(report)
    capture = found["target_layer_capture"]
    assert capture["severity"] == "divergence" and "layer input tensor is null" in capture["message"]
    assert re.fullmatch(r"llama\.cpp/src/llama-graph\.cpp:\d+", capture["source"])
    assert found["spec_draft_n_max"]["severity"] == "warning"  # left out: the default of 3 is flagged
    assert found["draft_sampling"]["severity"] == "info"
    assert set(found) == {"target_layer_capture", "spec_draft_n_max", "draft_sampling"}
    assert report["command"].startswith("llama-server -m ") and f"-md {drafter}" in report["command"]
    assert "--spec-type draft-dflash --spec-draft-n-max 7" in report["command"]


def test_a_short_draft_length_and_a_rounding_draft_kv_cache_are_findings(full_gguf, tmp_path):
    drafter, world = full_gguf
    _, report = serve_check(tmp_path, drafter, world.target, "--spec-draft-n-max", "3", "--draft-kv-type", "q8_0")
    found = by_field(report)
    assert found["block_size"]["served"] == 4 and found["block_size"]["trained"] == 8
    assert found["draft_kv_type"]["severity"] == "warning" and "spec_draft_n_max" not in found


def test_a_mixed_drafter_has_its_sliding_layer_served_non_causal_and_speculators_does_not_convert(test_world, tmp_path):
    from dflash_audit.conversion import convert
    from dflash_world.drafter import cached_test_drafter

    zlab = tmp_path / "zlab"
    convert(cached_test_drafter(test_world), zlab, "zlab")
    _, report = serve_check(tmp_path, zlab, test_world.target, "--spec-draft-n-max", "7")
    causal = by_field(report)["layer_causal"]
    assert causal["trained"] == [True, False] and causal["served"] == [False, False]
    assert re.fullmatch(r"llama\.cpp/common/speculative\.cpp:\d+", causal["source"])
    speculators = tmp_path / "speculators"
    convert(cached_test_drafter(test_world), speculators, "speculators", target=test_world.target, allow_lossy=True)
    _, refused = serve_check(tmp_path, speculators, test_world.target)
    assert refused["loads"] is False and "DFlashSpeculator" in refused["error"]


@pytest.mark.parametrize("case", ["missing", "not_executable"])
def test_a_missing_or_non_executable_llamacpp_bin_is_one_line_and_exit_2(full_gguf, tmp_path, capsys, case):
    drafter, world = full_gguf
    bin_dir = tmp_path / "bin"
    if case == "not_executable":
        bin_dir.mkdir()
        for name in ("llama-server", "llama-quantize"):
            (bin_dir / name).write_text("#!/bin/sh\n")
    capsys.readouterr()
    code = main(["serve-check", "--drafter", str(drafter), "--engine", "llamacpp", "--target", str(world.target),
                 "--live", "--llamacpp-bin", str(bin_dir)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "--llamacpp-bin" in err, err
    assert ("does not exist" if case == "missing" else "is not executable") in err


# -- the target GGUF cache -------------------------------------------------------------------------------------------
def test_the_target_cache_is_keyed_by_content_not_by_path(tmp_path, monkeypatch):
    """The same target in two folders shares one entry; a changed byte is another entry, also in a file past the
    whole-file bound, which is read as its samples (the bound lowered here to reach that path)."""
    from serving_engines.live import llamacpp_convert as convert

    first, second = tmp_path / "a", tmp_path / "b"
    for folder in (first, second):
        folder.mkdir()
        (folder / "config.json").write_text('{"hidden_size": 64}')
        (folder / "model.safetensors").write_bytes(bytes(range(256)) * 4096)  # 1 MiB
    assert convert.target_key(first) == convert.target_key(second)
    assert convert.target_gguf_path(first) == convert.target_gguf_path(second)
    (second / "config.json").write_text('{"hidden_size": 65}')
    assert convert.target_key(first) != convert.target_key(second)

    monkeypatch.setattr(convert, "WHOLE_FILE_BYTES", 1000)
    monkeypatch.setattr(convert, "SAMPLE_BYTES", 4096)
    (second / "config.json").write_text('{"hidden_size": 64}')
    assert convert.target_key(first) == convert.target_key(second)
    weights = bytearray((second / "model.safetensors").read_bytes())
    weights[len(weights) // 2] ^= 1  # inside the middle sample: 256 samples of 4 KiB tile 1 MiB
    (second / "model.safetensors").write_bytes(bytes(weights))
    assert convert.target_key(first) != convert.target_key(second)


def test_only_the_most_recently_used_target_entries_are_kept(tmp_path):
    """Entries past the kept count go, oldest first; the one in use, a folder holding a user's file, and one whose
    lock another process holds are kept."""
    from filelock import FileLock

    from serving_engines.live.llamacpp_convert import KEPT_TARGETS, TARGET_FILE, prune_targets

    targets = tmp_path / "targets"
    entries = []
    for age in range(8):  # entry 0 the oldest
        entry = targets / f"key{age}"
        entry.mkdir(parents=True)
        (entry / TARGET_FILE).write_bytes(b"GGUF")
        os.utime(entry / TARGET_FILE, (1000 + age, 1000 + age))
        entries.append(entry)
    (entries[0] / "notes.txt").write_text("the user's")
    in_use = entries[1]
    with FileLock(str(entries[2] / "target-f32.lock")):
        removed = prune_targets(targets, in_use)
    assert sorted(removed) == entries[3:8 - (KEPT_TARGETS - 1)]
    kept = sorted(p for p in targets.iterdir())
    assert kept == [entries[0], entries[1], entries[2], *entries[8 - (KEPT_TARGETS - 1):]]

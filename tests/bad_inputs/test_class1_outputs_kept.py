"""Class 1, a user's files overwritten: an output never replaces what the tool did not write.

`compare --out` / `--json`, `eval --json` and `train --out` / `--json` refuse an existing file the tool did
not write (its own reports are recognised by their schema tag or page title); `--force` replaces it. A
`--cache-dir` inside an input is refused: the cache would write files and a lock there. A full disk (a real tmpfs)
gets one line before any work, and a cache cut short by one is taken back whole."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess

import pytest
import torch

from tests.bad_inputs.cli_run import assert_refused, run, tree_digest

USER_HTML = "<html><body>my own notes</body></html>\n"
USER_JSON = '{"mine": true}\n'


def static_compare(world, out, *extra):
    return ["compare", "--ours", world / "ours.pt", "--ref", world / "zref", "--out", out, *extra]


def users_folder(path):
    path.mkdir()
    (path / "index.html").write_text(USER_HTML)
    (path / "report.json").write_text(USER_JSON)
    return tree_digest(path)


def test_compare_out_keeps_a_users_report_files(world, tmp_path, capsys):
    before = users_folder(tmp_path / "mine")
    code, _, err = run(static_compare(world, tmp_path / "mine"), capsys)
    assert_refused(code, err, "--out", "mine", "index.html", "--force")
    assert tree_digest(tmp_path / "mine") == before


def test_compare_out_in_the_working_directory_keeps_the_users_files(world, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "report.json").write_text(USER_JSON)
    code, _, err = run(static_compare(world, "."), capsys)
    assert_refused(code, err, "--out", "report.json")
    assert (tmp_path / "report.json").read_text() == USER_JSON
    assert not (tmp_path / "index.html").exists()


def test_compare_json_keeps_a_users_file(world, tmp_path, capsys):
    notes = tmp_path / "notes.json"
    notes.write_text(USER_JSON)
    code, _, err = run(static_compare(world, tmp_path / "report", "--json", notes), capsys)
    assert_refused(code, err, "--json", "notes.json")
    assert notes.read_text() == USER_JSON and not (tmp_path / "report").exists()


def test_the_tools_own_report_is_replaced_and_force_replaces_a_users(world, tmp_path, capsys):
    out = tmp_path / "report"
    assert run(static_compare(world, out, "--json", tmp_path / "r.json"), capsys)[0] in (0, 1)
    first = json.loads((out / "report.json").read_text())
    assert first["schema"] == "dflash-audit/1"
    assert run(static_compare(world, out, "--json", tmp_path / "r.json"), capsys)[0] in (0, 1)  # a rerun
    (out / "index.html").write_text(USER_HTML)
    assert run(static_compare(world, out), capsys)[0] == 2
    assert run(static_compare(world, out, "--force"), capsys)[0] in (0, 1)
    assert "<title>dflash-audit:" in (out / "index.html").read_text()


def eval_argv(world, *extra):
    return ["eval", "--drafter", world / "ours.pt", "--target", world / "target", "--prompts",
            world / "prompts.jsonl", "--max-new-tokens", "4", *extra]


def test_eval_json_keeps_a_users_file(world, tmp_path, capsys):
    notes = tmp_path / "notes.json"
    notes.write_text(USER_JSON)
    code, _, err = run(eval_argv(world, "--json", notes), capsys)
    assert_refused(code, err, "--json", "notes.json", "--force")
    assert notes.read_text() == USER_JSON


def train_argv(world, out, *extra):
    return ["train", "--target", world / "target", "--data", world / "data.jsonl", "--out", out, "--steps", "1",
            "--seq-len", "48", "--block-size", "4", "--fc-layers", "0,1", *extra]


def test_train_out_keeps_someone_elses_checkpoint(world, tmp_path, capsys):
    theirs = tmp_path / "their.pt"
    torch.save({"model": {"w": torch.ones(3)}, "epoch": 7}, theirs)
    before = theirs.read_bytes()
    for extra in ([], ["--resume"]):
        code, _, err = run(train_argv(world, theirs, *extra), capsys)
        assert_refused(code, err, "--out", "their.pt")
        assert theirs.read_bytes() == before


def test_train_out_keeps_an_earlier_run_unless_resumed_or_forced(world, tmp_path, capsys):
    out = tmp_path / "c.pt"
    assert run(train_argv(world, out), capsys)[0] == 0
    before = out.read_bytes()
    code, _, err = run(train_argv(world, out), capsys)
    assert_refused(code, err, "--out", "--resume", "--force")
    assert out.read_bytes() == before
    assert run(train_argv(world, out, "--force"), capsys)[0] == 0


def test_train_json_keeps_a_users_file(world, tmp_path, capsys):
    notes = tmp_path / "stats.json"
    notes.write_text(USER_JSON)
    code, _, err = run(train_argv(world, tmp_path / "c.pt", "--json", notes), capsys)
    assert_refused(code, err, "--json", "stats.json")
    assert notes.read_text() == USER_JSON and not (tmp_path / "c.pt").exists()


def test_a_cache_dir_inside_an_input_is_refused(world, tmp_path, capsys):
    target = tmp_path / "target"
    shutil.copytree(world / "target", target)
    before = tree_digest(target)
    for argv in (["eval", "--drafter", world / "ours.pt", "--target", target, "--prompts", world / "prompts.jsonl",
                  "--max-new-tokens", "4", "--mode", "offline", "--cache-dir", target],
                 ["eval", "--drafter", world / "ours.pt", "--target", target, "--prompts", world / "prompts.jsonl",
                  "--max-new-tokens", "4", "--cache-dir", target / "cache"],
                 ["compare", "--ours", world / "ours.pt", "--ref", world / "zref", "--target", target,
                  "--out", tmp_path / "r", "--cache-dir", target]):
        code, _, err = run(argv, capsys)
        assert_refused(code, err, "--cache-dir", "--target")
        assert tree_digest(target) == before


def test_a_cache_dir_that_is_a_file_is_refused(world, tmp_path, capsys):
    for cache in (world / "notes.txt", "/dev/null"):
        code, _, err = run(eval_argv(world, "--mode", "offline", "--cache-dir", cache), capsys)
        assert_refused(code, err, "--cache-dir", str(cache), "not a directory")
    assert os.path.exists("/dev/null")


# -- a full disk: a real tmpfs of 64 KiB, mounted for the test (root only: mount(2) needs it) -------------------
@contextlib.contextmanager
def tiny_disk(folder, free_kib: int):
    """A 64 KiB tmpfs at `folder` with `free_kib` KiB left free by a filler file; unmounted afterwards."""
    folder.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(folder)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"a tmpfs cannot be mounted here ({mounted.stderr.decode().strip()}): the full-disk cases need root")
    try:
        (folder / "filler").write_bytes(b"\0" * ((64 - free_kib) << 10))
        yield folder
    finally:
        subprocess.run(["umount", str(folder)], check=True)


def entries(folder):
    return sorted(p.name for p in folder.rglob("*"))


def test_a_full_disk_gets_one_line_and_keeps_nothing(world, tmp_path, capsys):
    eval_argv = ["eval", "--drafter", world / "ours.pt", "--target", world / "target", "--prompts",
                 world / "prompts.jsonl", "--max-new-tokens", "8"]
    with tiny_disk(tmp_path / "full", free_kib=0) as disk:
        for argv, flag in ((eval_argv + ["--json", disk / "new" / "eval.json"], "--json"),
                           (eval_argv + ["--mode", "offline", "--cache-dir", disk / "cache"], "--cache-dir"),
                           (static_compare(world, disk / "report"), "--out")):
            code, out, err = run(argv, capsys)
            assert_refused(code, err, flag, "No space left on device")
            assert out == "" and entries(disk) == ["filler"], (argv, entries(disk))
    # Room for the probe's byte but not for the cache: the cache cut short is taken back, whole.
    with tiny_disk(tmp_path / "nearly-full", free_kib=8) as disk:
        code, out, err = run(eval_argv + ["--mode", "offline", "--cache-dir", disk / "cache"], capsys)
        assert_refused(code, err, "cache", "No space left on device")
        assert entries(disk) == ["filler"], entries(disk)

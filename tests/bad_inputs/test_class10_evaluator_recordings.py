"""Class 10, evaluator recordings fed to the evaluator audit (`trace --from`): a recording of examples/own_evaluator.py
(one prompt) made corrupt, truncated or hostile: its manifest unreadable, of another kind or nested past any parser,
its tensor file missing, cut, changed, a folder or a link loop, its events naming tensors it lacks, modules it does not
list, or kinds it has none of, its tensors (hash kept consistent) of other dtypes, shapes and ids past the vocabulary,
the target it names gone. Each is one line and exit 2 naming the recording (never the catch-all); the recording is
left as it was and no report folder is made."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from dflash_audit.trace.evaluation.recorder import MANIFEST, TENSORS
from tests.bad_inputs.cli_run import assert_refused, run, tree_digest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def recording(test_world, tmp_path_factory) -> Path:
    """One prompt of examples/own_evaluator.py recorded (the world's drafter as a z-lab folder)."""
    from dflash_audit.trace.record.launch import record_script
    from dflash_world.drafter import cached_test_drafter
    from drafter_files.checkpoint import load_checkpoint
    from drafter_files.zlab_format import save_zlab_dir

    root = tmp_path_factory.mktemp("evaluator-recording")
    checkpoint = load_checkpoint(cached_test_drafter(test_world))
    save_zlab_dir(root / "drafter", checkpoint.spec, checkpoint.state_dict)
    record_script(REPO / "examples" / "own_evaluator.py",
                  ["--drafter", str(root / "drafter"), "--target", str(test_world.target), "--prompts",
                   str(test_world.prompts), "--max-new-tokens", "16", "--limit", "1"], root / "rec")
    return root / "rec"


def edit_manifest(change):
    def edit(rec: Path) -> None:
        manifest = json.loads((rec / MANIFEST).read_text())
        changed = change(manifest)
        (rec / MANIFEST).write_text(json.dumps(manifest if changed is None else changed))
    return edit


def first(kind: str):
    return lambda manifest: next(e for e in manifest["events"] if e["kind"] == kind)


def edit_tensor(key_of, change):
    """One tensor changed and the manifest's size and hash updated with it: an edit the file checks cannot see."""
    def edit(rec: Path) -> None:
        manifest = json.loads((rec / MANIFEST).read_text())
        tensors = load_file(str(rec / TENSORS))
        key = key_of(manifest)
        tensors[key] = change(tensors[key])
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(rec / TENSORS))
        manifest["tensors_bytes"] = (rec / TENSORS).stat().st_size
        manifest["tensors_sha256"] = hashlib.sha256((rec / TENSORS).read_bytes()).hexdigest()
        (rec / MANIFEST).write_text(json.dumps(manifest))
    return edit


def _flip_a_byte(rec: Path) -> None:
    data = bytearray((rec / TENSORS).read_bytes())
    data[len(data) // 2] ^= 0xFF
    (rec / TENSORS).write_bytes(bytes(data))


def _replace(path: Path, make) -> None:
    path.unlink()
    make(path)


CASES = {
    "manifest_not_json": lambda rec: (rec / MANIFEST).write_text("{ not json"),
    "manifest_empty": lambda rec: (rec / MANIFEST).write_bytes(b""),
    "manifest_a_list": lambda rec: (rec / MANIFEST).write_text("[1, 2]"),
    "manifest_nested_past_any_parser": lambda rec: (rec / MANIFEST).write_text("[" * 200_000 + "]" * 200_000),
    "manifest_not_utf8": lambda rec: (rec / MANIFEST).write_bytes(b'{"schema": "\xff\xfe"}'),
    "manifest_of_another_schema": edit_manifest(lambda m: m.update(schema="dflash-audit/trace-evaluation/99")),
    "manifest_a_folder": lambda rec: _replace(rec / MANIFEST, Path.mkdir),
    "tensors_missing": lambda rec: (rec / TENSORS).unlink(),
    "tensors_truncated": lambda rec: (rec / TENSORS).write_bytes((rec / TENSORS).read_bytes()[:1000]),
    "tensors_changed": _flip_a_byte,
    "tensors_a_folder": lambda rec: _replace(rec / TENSORS, Path.mkdir),
    "tensors_a_link_loop": lambda rec: _replace(rec / TENSORS, lambda p: (p.symlink_to(p.with_name("x")),
                                                                          p.with_name("x").symlink_to(p))),
    "tensors_a_fifo": lambda rec: _replace(rec / TENSORS, os.mkfifo),
    "size_a_string": edit_manifest(lambda m: m.update(tensors_bytes="many")),
    "events_a_string": edit_manifest(lambda m: m.update(events="all of them")),
    "events_none": edit_manifest(lambda m: m.update(events=[])),
    "an_event_a_number": edit_manifest(lambda m: m["events"].insert(0, 7)),
    "an_event_of_an_unknown_kind": edit_manifest(lambda m: first("drafter")(m).update(kind="oracle")),
    "an_event_naming_a_tensor_not_held": edit_manifest(lambda m: first("target")(m).update(ids="e999.ids")),
    "an_event_of_a_module_not_listed": edit_manifest(lambda m: first("drafter")(m).update(module=99)),
    "an_event_of_a_module_named_by_text": edit_manifest(lambda m: first("drafter")(m).update(module="drafter")),
    "modules_none": edit_manifest(lambda m: m.update(modules=[])),
    "modules_a_mapping": edit_manifest(lambda m: m.update(modules={"0": "target"})),
    "target_path_gone": edit_manifest(lambda m: (m["target"].update(path="/nonexistent/target"),
                                                 [mod.update(path="/nonexistent/target") for mod in m["modules"]])),
    "target_path_a_number": edit_manifest(lambda m: (m["target"].update(path=5),
                                                     [mod.update(path=5) for mod in m["modules"]])),
    "ids_of_floats": edit_tensor(lambda m: first("target")(m)["ids"], lambda t: t.float()),
    "ids_of_another_rank": edit_tensor(lambda m: first("target")(m)["ids"], lambda t: t.reshape(-1)[:3]),
    "ids_past_the_vocabulary": edit_tensor(lambda m: first("target")(m)["ids"], lambda t: torch.full_like(t, 1 << 40)),
    "negative_ids": edit_tensor(lambda m: first("target")(m)["ids"], lambda t: torch.full_like(t, -5)),
    "ids_of_no_token": edit_tensor(lambda m: first("target")(m)["ids"], lambda t: t[..., :0]),
    "argmax_past_the_vocabulary": edit_tensor(lambda m: first("target")(m)["argmax"],
                                              lambda t: torch.full_like(t, 1 << 40)),
    "margins_of_integers": edit_tensor(lambda m: first("target")(m)["margin"], lambda t: t.long()),
    "positions_empty": edit_tensor(lambda m: first("target")(m)["positions"], lambda t: t[..., :0]),
}


def test_the_recording_unchanged_is_audited(recording, tmp_path, capsys):
    code, _, err = run(["trace", "--from", recording, "--out", tmp_path / "report"], capsys)
    assert code == 0, err


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_hostile_evaluator_recording_is_one_line_and_exit_2(recording, tmp_path, capsys, case):
    rec = tmp_path / "rec"
    shutil.copytree(recording, rec)
    CASES[case](rec)
    before = tree_digest(tmp_path)
    code, _, err = run(["trace", "--from", rec, "--out", tmp_path / "report"], capsys)
    assert_refused(code, err, "--from")
    assert tree_digest(tmp_path) == before  # the recording as it was, no report folder, no temp file

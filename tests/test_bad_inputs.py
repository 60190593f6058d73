"""Every bad input gets a one-line answer and exit status 2, and nothing the tool did not make
is touched: each case checks the status, that stderr is exactly one `dflash-audit: error:` line
naming the file or flag, no traceback, and that the input tree is byte-identical afterwards.

Loader cases (broken drafters) live with the loaders; this matrix covers the CLI, outputs,
limits, targets and prompts files. The hostile inputs of issue #32 live in tests/bad_inputs/, one file per
class: test_class1_outputs_kept (a user's files overwritten), test_class2_verdicts (wrong verdicts),
test_class3_bombs (hangs and memory blow-ups), test_class4_no_internal_names (internal exception names),
test_class5_named_messages (messages that name the wrong thing), test_class6_valid_layouts (valid inputs
refused or left broken), and test_fuzz (every reader fuzzed). Cases that could block (FIFOs) run in a subprocess with a
timeout, as do the SIGKILL tests of interrupted writes.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from dflash_audit.cli import main
from dflash_audit.formats import load_any
from dflash_world.target_training import random_qwen3
from dflash_world.tokenizer import mask_token_id, train_tokenizer
from drafter_files.checkpoint import load_checkpoint, save_checkpoint
from impl.model import DFlashDrafter
from drafter_files.zlab_format import save_zlab_dir
from tests.bad_inputs.cli_run import tree_digest
from tests.helpers import tiny_spec

REPO = Path(__file__).resolve().parents[1]
TEXTS = [f"def add_{i}(x, y):\n    total = x + y * {i}\n    return total\n" for i in range(24)]
MAX_POSITIONS = 64  # the tiny target's context window: prompt length limits are cheap to hit
HUGE = str(10**21)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


# -- the input world: a tiny target with a tokenizer, drafters, prompts, data -------------------
def _save_target(path: Path, tokenizer) -> None:
    random_qwen3(2, 64, len(tokenizer), max_positions=MAX_POSITIONS).save_pretrained(path)
    tokenizer.save_pretrained(path)


def _broken_target(world: Path, name: str, **fields) -> None:
    """A copy of the target whose config.json has `fields` replaced."""
    path = world / name
    shutil.copytree(world / "target", path)
    config = json.loads((path / "config.json").read_text())
    config.update(fields)
    (path / "config.json").write_text(json.dumps(config))


def _drafter(tokenizer) -> DFlashDrafter:
    torch.manual_seed(0)
    return DFlashDrafter(tiny_spec(num_hidden_layers=1, layer_types=("full_attention",), sliding_window=None,
                                   target_vocab_size=len(tokenizer), target_layer_ids=(0, 1), num_target_layers=2,
                                   mask_token_id=mask_token_id(tokenizer), block_size=4))


def _write_jsonl(path: Path, records: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> Path:
    return build_world(tmp_path_factory.mktemp("inputs"))


def build_world(root: Path) -> Path:
    """The hostile-input world under `root` (also built once per session by tests/bad_inputs/)."""
    tokenizer = train_tokenizer(TEXTS, vocab_size=300)
    _save_target(root / "target", tokenizer)
    drafter = _drafter(tokenizer)
    save_checkpoint(root / "ours.pt", drafter)
    save_zlab_dir(root / "zref", drafter.spec, drafter.state_dict())
    nan = {k: torch.full_like(v, float("nan")) for k, v in drafter.state_dict().items()}
    save_zlab_dir(root / "nan-zlab", drafter.spec, nan)
    inf = dict(drafter.state_dict(), **{"fc.weight": torch.full_like(drafter.state_dict()["fc.weight"], float("inf"))})
    save_zlab_dir(root / "inf-zlab", drafter.spec, inf)
    _write_jsonl(root / "prompts.jsonl", [{"id": "a", "prompt": "def add(x, y):"}, {"id": "b", "prompt": "import os"}])
    _write_jsonl(root / "long.jsonl", [{"id": "short", "prompt": "x = 1"}, {"id": "long", "prompt": TEXTS[0] * 8}])
    (root / "latin1.jsonl").write_bytes('{"id": "é", "prompt": "café"}\n'.encode("latin-1"))
    _write_jsonl(root / "data.jsonl", [{"text": t} for t in TEXTS])
    (root / "notes.txt").write_text("someone else's file\n")

    no_tokenizer = root / "no-tokenizer"
    shutil.copytree(root / "target", no_tokenizer)
    for name in TOKENIZER_FILES:
        (no_tokenizer / name).unlink()
    _broken_target(root, "bad-act", hidden_act="wibble")
    _broken_target(root, "bad-hidden", hidden_size="sixty-four")
    _broken_target(root, "bad-positions", max_position_embeddings="sixty-four")
    _broken_target(root, "zero-heads", num_attention_heads=0)
    _broken_target(root, "null-vocab", vocab_size=None)
    _broken_target(root, "bad-rope", rope_parameters="x")
    shutil.copytree(root / "target", root / "latin1-config")
    (root / "latin1-config" / "config.json").write_bytes(b'{"model_type": "qwen3", "name": "caf\xe9"}')

    shutil.copytree(root / "zref", root / "zlab-plus")  # a z-lab drafter that also holds a user's file
    (root / "zlab-plus" / "README.md").write_text("mine\n")
    (root / "folder").mkdir()
    (root / "folder" / "keep.txt").write_text("keep\n")
    (root / "prompts-link.jsonl").symlink_to(root / "prompts.jsonl")
    (root / "zref-link").symlink_to(root / "zref")
    _broken_drafters(root, drafter)
    return root


def _broken_zlab(root: Path, name: str, edit) -> None:
    """A copy of the z-lab reference with `edit(folder)` applied."""
    shutil.copytree(root / "zref", root / name)
    edit(root / name)


def _edit_config(**fields):
    def edit(folder: Path) -> None:
        config = json.loads((folder / "config.json").read_text())
        config.update({k: v for k, v in fields.items() if k != "dflash_config"})
        config["dflash_config"].update(fields.get("dflash_config", {}))
        (folder / "config.json").write_text(json.dumps(config))
    return edit


def _index(weight_map) -> callable:
    def edit(folder: Path) -> None:
        (folder / "model.safetensors").rename(folder / "shard.safetensors")
        (folder / "model.safetensors.index.json").write_text(json.dumps(weight_map))
    return edit


def _broken_drafters(root: Path, drafter: DFlashDrafter) -> None:
    """Drafters every loader must refuse in one line: corrupt, contradictory, malicious, ambiguous."""
    names = list(drafter.state_dict())
    _broken_zlab(root, "truncated-zlab", lambda f: (f / "model.safetensors").write_bytes(
        (f / "model.safetensors").read_bytes()[:200]))
    _broken_zlab(root, "layers-in-words-zlab", _edit_config(num_target_layers="sixty-four"))
    _broken_zlab(root, "fractional-ids-zlab", _edit_config(dflash_config={"target_layer_ids": [0.7, 1.2]}))
    _broken_zlab(root, "unknown-act-zlab", _edit_config(hidden_act="wibble"))
    _broken_zlab(root, "rope-string-zlab", _edit_config(rope_parameters="x"))
    _broken_zlab(root, "list-config-zlab", lambda f: (f / "config.json").write_text("[]"))
    _broken_zlab(root, "latin1-config-zlab", lambda f: (f / "config.json").write_bytes(b'{"name": "caf\xe9"}'))
    _broken_zlab(root, "index-outside-zlab", _index({"weight_map": {k: "../ours.pt" for k in names}}))
    _broken_zlab(root, "index-absolute-zlab", _index({"weight_map": {k: "/etc/passwd" for k in names}}))
    _broken_zlab(root, "index-without-map-zlab", _index({"files": ["shard.safetensors"]}))
    _broken_zlab(root, "index-missing-shard-zlab", _index({"weight_map": {k: "gone.safetensors" for k in names}}))
    (root / "loop").symlink_to(root / "loop")
    state = drafter.state_dict()
    torch.save({"model": state, "ema": state}, root / "two-state-dicts.pt")
    torch.save({**state, "module.fc.weight": state["fc.weight"]}, root / "collide.pt")
    torch.save({"epoch": 3, "args": {"gamma": 4.0}}, root / "no-weights.pt")
    torch.save({"model": state}, root / "plain.pt")

    class SystemCall:
        def __reduce__(self):
            return (os.system, (f"touch {root}/canary",))

    torch.save({"model": state, "args": SystemCall()}, root / "evil.pt")
    (root / "bad-regex.map").write_text("^blocks\\.(\\d+ => layers.\\1\n")
    (root / "no-arrow.map").write_text("blocks layers\n")
    (root / "latin1-data.jsonl").write_bytes('{"text": "caf\xe9"}\n'.encode("latin-1"))


def assert_one_line_error(code: int, err: str, *names: str) -> None:
    lines = err.strip("\n").splitlines()
    assert code == 2, err
    assert len(lines) == 1, err
    assert lines[0].startswith("dflash-audit: error: "), err
    assert "Traceback" not in err
    for name in names:
        assert name in lines[0], (name, err)


# -- the matrix ----------------------------------------------------------------------------------
# Each case: argv with {w} (the input world) and {t} (a fresh scratch folder, the cwd), and the
# strings the error line must contain (the file, field or flag it names).
EVAL = ["eval", "--drafter", "{w}/ours.pt", "--target", "{w}/target", "--prompts", "{w}/prompts.jsonl",
        "--max-new-tokens", "8"]
COMPARE = ["compare", "--ours", "{w}/ours.pt", "--ref", "{w}/zref", "--target", "{w}/target",
           "--prompts", "{w}/prompts.jsonl", "--max-new-tokens", "8", "--out", "{t}/report"]
TRAIN = ["train", "--target", "{w}/target", "--data", "{w}/data.jsonl", "--out", "{t}/c.pt", "--steps", "1",
         "--seq-len", "48", "--block-size", "4", "--fc-layers", "0,1"]
CONVERT = ["convert", "--from", "{w}/zref", "--format", "zlab"]


def with_option(base: list[str], flag: str, value: str) -> list[str]:
    """`base` with `flag` set to `value` (replaced if present)."""
    argv = list(base)
    if flag in argv:
        argv[argv.index(flag) + 1] = value
    else:
        argv += [flag, value]
    return argv


CASES = {
    # usage
    "no-arguments": ([], ["no command given"]),
    "unknown-command": (["frobnicate"], ["frobnicate"]),
    # flags out of range or not finite
    "eval-max-new-tokens-0": (with_option(EVAL, "--max-new-tokens", "0"), ["--max-new-tokens"]),
    "eval-max-new-tokens-huge": (with_option(EVAL, "--max-new-tokens", HUGE), ["--max-new-tokens", HUGE]),
    "eval-max-new-tokens-nan": (with_option(EVAL, "--max-new-tokens", "nan"), ["--max-new-tokens"]),
    "eval-budget-0": (with_option(EVAL, "--budget", "0"), ["--budget"]),
    "eval-budget-huge": (with_option(EVAL, "--budget", HUGE), ["--budget", HUGE]),
    "eval-budget-inf": (with_option(EVAL, "--budget", "inf"), ["--budget"]),
    "eval-temperature-nan": (with_option(EVAL, "--temperature", "nan"), ["--temperature", "nan"]),
    "eval-temperature-inf": (with_option(EVAL, "--temperature", "inf"), ["--temperature", "inf"]),
    "eval-temperature-negative": (with_option(EVAL, "--temperature", "-1"), ["--temperature"]),
    "eval-temperature-huge": (with_option(EVAL, "--temperature", "1e21"), ["--temperature"]),
    "compare-max-new-tokens-huge": (with_option(COMPARE, "--max-new-tokens", HUGE), ["--max-new-tokens"]),
    "compare-budget-0": (with_option(COMPARE, "--budget", "0"), ["--budget"]),
    "compare-budget-nan": (with_option(COMPARE, "--budget", "nan"), ["--budget"]),
    "train-lr-nan": (with_option(TRAIN, "--lr", "nan"), ["--lr"]),
    "train-gamma-inf": (with_option(TRAIN, "--gamma", "inf"), ["--gamma"]),
    # prompt + --max-new-tokens beyond the target's context window
    "eval-prompt-too-long": (with_option(EVAL, "--prompts", "{w}/long.jsonl"),
                             ["long.jsonl", "'long'", f"max_position_embeddings {MAX_POSITIONS}", "--truncate"]),
    "compare-prompt-too-long": (with_option(COMPARE, "--prompts", "{w}/long.jsonl"),
                                ["long.jsonl", "'long'", f"max_position_embeddings {MAX_POSITIONS}"]),
    "eval-no-room-for-a-prompt": (with_option(EVAL, "--max-new-tokens", str(MAX_POSITIONS)),
                                  ["--max-new-tokens", str(MAX_POSITIONS)]),
    # prompts files
    "eval-prompts-not-utf8": (with_option(EVAL, "--prompts", "{w}/latin1.jsonl"), ["latin1.jsonl:1", "UTF-8"]),
    "compare-prompts-not-utf8": (with_option(COMPARE, "--prompts", "{w}/latin1.jsonl"), ["latin1.jsonl", "UTF-8"]),
    "eval-prompts-a-directory": (with_option(EVAL, "--prompts", "{w}/folder"), ["folder", "not a regular file"]),
    "eval-prompts-missing": (with_option(EVAL, "--prompts", "{w}/missing.jsonl"), ["missing.jsonl"]),
    # targets
    "eval-target-without-tokenizer": (with_option(EVAL, "--target", "{w}/no-tokenizer"),
                                      ["no-tokenizer", "no tokenizer"]),
    "compare-target-without-tokenizer": (with_option(COMPARE, "--target", "{w}/no-tokenizer"),
                                         ["no-tokenizer", "no tokenizer"]),
    "eval-target-unknown-hidden-act": (with_option(EVAL, "--target", "{w}/bad-act"),
                                       ["bad-act/config.json", "hidden_act", "wibble"]),
    "eval-target-hidden-size-in-words": (with_option(EVAL, "--target", "{w}/bad-hidden"),
                                         ["bad-hidden/config.json", "hidden_size", "sixty-four"]),
    "eval-target-positions-in-words": (with_option(EVAL, "--target", "{w}/bad-positions"),
                                       ["bad-positions/config.json", "max_position_embeddings"]),
    "eval-target-zero-heads": (with_option(EVAL, "--target", "{w}/zero-heads"),
                               ["zero-heads/config.json", "num_attention_heads"]),
    "eval-target-null-vocab": (with_option(EVAL, "--target", "{w}/null-vocab"),
                               ["null-vocab/config.json", "vocab_size"]),
    "eval-target-bad-rope": (with_option(EVAL, "--target", "{w}/bad-rope"), ["bad-rope/config.json", "rope_parameters"]),
    "eval-target-config-not-utf8": (with_option(EVAL, "--target", "{w}/latin1-config"),
                                    ["latin1-config/config.json", "UTF-8"]),
    "eval-target-a-file": (with_option(EVAL, "--target", "{w}/notes.txt"), ["--target", "notes.txt"]),
    "eval-target-missing": (with_option(EVAL, "--target", "{w}/missing"), ["--target", "missing"]),
    "train-target-unknown-hidden-act": (with_option(TRAIN, "--target", "{w}/bad-act"),
                                        ["bad-act/config.json", "hidden_act"]),
    "compare-target-hidden-size-in-words": (with_option(COMPARE, "--target", "{w}/bad-hidden"),
                                            ["bad-hidden/config.json", "hidden_size"]),
    # non-finite drafters
    "eval-all-nan-drafter": (with_option(EVAL, "--drafter", "{w}/nan-zlab"), ["nan-zlab", "non-finite", "'"]),
    "eval-inf-fc-drafter": (with_option(EVAL, "--drafter", "{w}/inf-zlab"), ["inf-zlab", "'fc.weight'", "non-finite"]),
    # outputs that are, hold or sit inside inputs
    "eval-json-is-the-prompts": (EVAL + ["--json", "{w}/prompts.jsonl"], ["--json", "--prompts"]),
    "eval-json-via-symlink": (EVAL + ["--json", "{w}/prompts-link.jsonl"], ["--json", "--prompts"]),
    "eval-json-inside-the-target": (EVAL + ["--json", "{w}/target/out.json"], ["--json", "inside", "--target"]),
    "compare-out-holds-the-drafter": (with_option(COMPARE, "--out", "{w}"), ["--out", "contains", "--ours"]),
    "compare-out-is-a-drafter": (with_option(COMPARE, "--out", "{w}/ours.pt"), ["--out", "--ours"]),
    "compare-json-inside-the-ref": (COMPARE + ["--json", "{w}/zref/config.json"], ["--json", "--ref"]),
    "convert-to-the-source-parent": (CONVERT + ["--to", "{w}"], ["--to", "contains", "--from"]),
    "convert-to-the-source-link": (CONVERT + ["--to", "{w}/zref-link"], ["--to", "--from"]),
    "convert-to-cwd": (CONVERT + ["--to", "."], ["--to .", "not a zlab drafter"]),
    "convert-to-proc": (CONVERT + ["--to", "/proc/dflash-x"], ["--to /proc/dflash-x", "cannot write"]),
    "convert-to-a-folder": (CONVERT + ["--to", "{w}/folder", "--force"], ["{w}/folder", "not a zlab drafter"]),
    "convert-to-a-drafter-without-force": (["convert", "--from", "{w}/ours.pt", "--format", "zlab", "--to",
                                            "{w}/zref"], ["{w}/zref", "--force"]),
    "convert-to-a-drafter-with-user-files": (["convert", "--from", "{w}/ours.pt", "--format", "zlab", "--to",
                                              "{w}/zlab-plus", "--force"], ["zlab-plus", "README.md"]),
    "convert-to-another-format": (["convert", "--from", "{w}/zref", "--format", "ours", "--to", "{w}/ours.pt"],
                                  ["{w}/ours.pt", "--force"]),
    "convert-to-a-symlinked-drafter": (["convert", "--from", "{w}/ours.pt", "--format", "zlab", "--to",
                                        "{w}/zref-link", "--force"], ["zref-link"]),
    "train-out-a-directory": (with_option(TRAIN, "--out", "{w}/folder"), ["--out", "folder", "directory"]),
    "train-out-is-the-data": (with_option(TRAIN, "--out", "{w}/data.jsonl"), ["--out", "--data"]),
    "train-out-someone-elses-file": (with_option(TRAIN, "--out", "{t}/notes.txt"), ["--out", "notes.txt"]),
    "train-out-unwritable": (with_option(TRAIN, "--out", "/proc/dflash-x.pt"), ["--out /proc/dflash-x.pt"]),
    "train-json-inside-the-target": (TRAIN + ["--json", "{w}/target/stats.json"], ["--json", "--target"]),
    "train-resume-from-a-directory": (with_option(TRAIN, "--out", "{w}/zref") + ["--resume"], ["--out", "zref"]),
    "demo-world-dir-someone-elses-folder": (["demo", "--world-dir", "{w}", "--out", "{t}/demo"],
                                            ["--world-dir", "demo world"]),
    "demo-world-dir-a-file": (["demo", "--world-dir", "{w}/notes.txt", "--out", "{t}/demo"], ["--world-dir", "notes.txt"]),
    # the old name of --world-dir still works (unlisted)
    "demo-cache-alias-someone-elses-folder": (["demo", "--cache", "{w}", "--out", "{t}/demo"], ["--world-dir", "demo world"]),
    # drafters the loaders refuse, naming the file and the field
    "compare-truncated-safetensors": (with_option(COMPARE, "--ref", "{w}/truncated-zlab"),
                                      ["truncated-zlab/model.safetensors", "unreadable safetensors"]),
    "compare-layer-count-in-words": (with_option(COMPARE, "--ref", "{w}/layers-in-words-zlab"),
                                     ["layers-in-words-zlab/config.json", "num_target_layers", "sixty-four"]),
    "compare-fractional-layer-ids": (with_option(COMPARE, "--ref", "{w}/fractional-ids-zlab"),
                                     ["fractional-ids-zlab/config.json", "target_layer_ids", "[0.7, 1.2]"]),
    "compare-unknown-activation": (with_option(COMPARE, "--ref", "{w}/unknown-act-zlab"),
                                   ["unknown-act-zlab/config.json", "hidden_act", "wibble"]),
    "compare-rope-not-a-mapping": (with_option(COMPARE, "--ref", "{w}/rope-string-zlab"),
                                   ["rope-string-zlab/config.json", "rope_parameters"]),
    "compare-config-a-list": (with_option(COMPARE, "--ref", "{w}/list-config-zlab"),
                              ["list-config-zlab/config.json", "JSON object"]),
    "compare-config-not-utf8": (with_option(COMPARE, "--ref", "{w}/latin1-config-zlab"),
                                ["latin1-config-zlab/config.json", "not valid JSON"]),
    "compare-index-names-a-file-outside": (with_option(COMPARE, "--ref", "{w}/index-outside-zlab"),
                                           ["model.safetensors.index.json", "../ours.pt", "outside"]),
    "compare-index-names-an-absolute-path": (with_option(COMPARE, "--ref", "{w}/index-absolute-zlab"),
                                             ["model.safetensors.index.json", "/etc/passwd", "outside"]),
    "compare-index-without-weight-map": (with_option(COMPARE, "--ref", "{w}/index-without-map-zlab"),
                                         ["model.safetensors.index.json", "weight_map"]),
    "compare-index-missing-shard": (with_option(COMPARE, "--ref", "{w}/index-missing-shard-zlab"),
                                    ["model.safetensors.index.json", "gone.safetensors", "missing"]),
    "compare-symlink-loop": (with_option(COMPARE, "--ours", "{w}/loop"), ["{w}/loop"]),
    "compare-malicious-pickle": (with_option(COMPARE, "--ours", "{w}/evil.pt"),
                                 ["evil.pt", "system", "nothing was run"]),
    "compare-two-state-dicts": (with_option(COMPARE, "--ours", "{w}/two-state-dicts.pt"),
                                ["two-state-dicts.pt", "ema, model", "--ours-entry"]),
    "compare-two-names-one-tensor": (with_option(COMPARE, "--ours", "{w}/collide.pt"),
                                     ["collide.pt", "'fc.weight'", "'module.fc.weight'"]),
    "compare-no-weights-in-the-file": (with_option(COMPARE, "--ours", "{w}/no-weights.pt"),
                                       ["no-weights.pt", "no entry holds a state dict", "epoch"]),
    "compare-entry-that-is-not-there": (with_option(COMPARE, "--ours", "{w}/plain.pt") + ["--ours-entry", "ema"],
                                        ["plain.pt", "--ours-entry ema", "model"]),
    "compare-key-map-bad-regex": (with_option(COMPARE, "--ours", "{w}/plain.pt") + ["--key-map", "{w}/bad-regex.map"],
                                  ["bad-regex.map:1", "invalid pattern"]),
    "compare-key-map-without-arrow": (with_option(COMPARE, "--ours", "{w}/plain.pt") + ["--key-map",
                                                                                          "{w}/no-arrow.map"],
                                      ["no-arrow.map:1", "PATTERN => REPLACEMENT"]),
    "compare-spec-unknown-field": (COMPARE + ["--ours-spec", "colour=blue"], ["--ours-spec colour", "not a spec"]),
    "compare-spec-value-in-words": (with_option(COMPARE, "--ours", "{w}/plain.pt") +
                                    ["--ours-spec", "num_target_layers=sixty-four"],
                                    ["--ours-spec num_target_layers", "sixty-four"]),
    "eval-incomplete-foreign-spec": (with_option(EVAL, "--drafter", "{w}/plain.pt"),
                                     ["plain.pt", "eval needs the whole spec", "mask_token_id", "--spec"]),
    "train-data-not-utf8": (with_option(TRAIN, "--data", "{w}/latin1-data.jsonl"),
                            ["latin1-data.jsonl:1", "UTF-8"]),
}


def render(argv: list[str], world: Path, scratch: Path) -> list[str]:
    return [a.replace("{w}", str(world)).replace("{t}", str(scratch)) for a in argv]


@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_input_gets_one_line_and_exit_2(name, world, tmp_path, monkeypatch, capsys):
    argv, names = CASES[name]
    monkeypatch.chdir(tmp_path)  # `--to .` and default outputs land in the scratch folder
    (tmp_path / "notes.txt").write_text("scratch file\n")
    before = tree_digest(world)
    code = main(render(argv, world, tmp_path))
    err = capsys.readouterr().err
    assert_one_line_error(code, err, *(n.replace("{w}", str(world)) for n in names))
    assert tree_digest(world) == before
    assert (tmp_path / "notes.txt").read_text() == "scratch file\n"


def test_the_matrix_is_at_least_60_cases():
    assert len(CASES) >= 60


# -- FIFOs: must not hang (a subprocess with a timeout, since a hang would stop the suite) -------
FIFO_CASES = {
    "eval-prompts-fifo": (with_option(EVAL, "--prompts", "{t}/fifo"), ["fifo", "not a regular file"]),
    "eval-target-config-fifo": (with_option(EVAL, "--target", "{t}/fifo-target"), ["config.json", "FIFO"]),
    "train-eval-data-fifo": (TRAIN + ["--eval-data", "{t}/fifo"], ["--eval-data", "fifo"]),
}


@pytest.mark.parametrize("name", sorted(FIFO_CASES))
def test_a_fifo_is_refused_without_hanging(name, world, tmp_path):
    argv, names = FIFO_CASES[name]
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "fifo-target").mkdir()
    for entry in (world / "target").iterdir():
        shutil.copy(entry, tmp_path / "fifo-target")
    (tmp_path / "fifo-target" / "config.json").unlink()
    os.mkfifo(tmp_path / "fifo-target" / "config.json")
    before = tree_digest(world)
    run = subprocess.run([sys.executable, "-m", "dflash_audit.cli", *render(argv, world, tmp_path)], cwd=tmp_path,
                         capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert_one_line_error(run.returncode, run.stderr, *names)
    assert tree_digest(world) == before


# -- --debug: the same exit status, the traceback added --------------------------------------------
def test_debug_adds_the_traceback_and_keeps_exit_2(world, tmp_path, capsys):
    code = main(render(with_option(EVAL, "--prompts", "{w}/latin1.jsonl"), world, tmp_path) + ["--debug"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert err[0] == "Traceback (most recent call last):"
    assert err[-1].startswith("dflash-audit: error: ") and "latin1.jsonl" in err[-1]


# -- what the checks let through -----------------------------------------------------------------
def test_truncate_keeps_the_last_tokens_and_says_so(world, tmp_path, capsys):
    out = tmp_path / "tau.json"
    code = main(render(with_option(EVAL, "--prompts", "{w}/long.jsonl"), world, tmp_path)
                + ["--truncate", "--json", str(out)])
    assert code == 0
    assert "prompt 'long' truncated to its last 56" in capsys.readouterr().err
    assert [p["id"] for p in json.loads(out.read_text())["prompts"]] == ["short", "long"]


def test_convert_force_replaces_only_a_same_format_drafter(world, tmp_path):
    dest = tmp_path / "z"
    assert main(["convert", "--from", str(world / "zref"), "--to", str(dest), "--format", "zlab"]) == 0
    (dest / "model.safetensors").write_bytes(b"stale")
    assert main(["convert", "--from", str(world / "ours.pt"), "--to", str(dest), "--format", "zlab", "--force"]) == 0
    assert load_any(dest).spec == load_any(world / "zref").spec
    assert sorted(p.name for p in tmp_path.iterdir()) == ["z"]  # no temp folder left beside it


@pytest.mark.parametrize("umask", [0o002, 0o077])
def test_written_files_follow_the_umask(world, tmp_path, umask):
    old = os.umask(umask)
    try:
        assert main(["convert", "--from", str(world / "zref"), "--to", str(tmp_path / "z"), "--format", "zlab"]) == 0
        assert main(["convert", "--from", str(world / "zref"), "--to", str(tmp_path / "o.pt"), "--format", "ours"]) == 0
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "z").stat().st_mode) == 0o777 & ~umask
    for path in (tmp_path / "z" / "model.safetensors", tmp_path / "z" / "config.json", tmp_path / "o.pt"):
        assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~umask, path


# -- SIGKILL mid-write: the previous output stays whole, the next write removes the leftovers ------
def _kill_mid_write(tmp_path: Path, patch: str, call: str) -> None:
    """Run `call` in a subprocess whose writer (`patch`) writes, touches `ready` and sleeps; SIGKILL it then."""
    ready = tmp_path / "ready"
    script = "\n".join(["import pathlib, sys, time", f"sys.path.insert(0, {str(REPO)!r})",
                        f"READY = pathlib.Path({str(ready)!r})", patch, call])
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=tmp_path, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while not ready.exists():
        assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
        assert time.monotonic() < deadline, "the writer never started"
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    proc.stderr.close()


def _leftovers(parent: Path) -> list[str]:
    tmp = parent / ".dflash-audit-tmp"
    return sorted(p.name for p in tmp.iterdir()) if tmp.exists() else []


def test_sigkill_during_convert_keeps_the_old_drafter_and_the_next_write_cleans_up(world, tmp_path):
    dest = tmp_path / "z"
    assert main(["convert", "--from", str(world / "zref"), "--to", str(dest), "--format", "zlab"]) == 0
    before = tree_digest(dest)
    patch = "\n".join([
        "import drafter_files.zlab_format as ckpt",
        "real = ckpt.save_file",
        "def stalled(*args, **kwargs):",
        "    real(*args, **kwargs)",
        "    READY.touch()",
        "    time.sleep(600)",
        "ckpt.save_file = stalled",
    ])
    call = (f"from dflash_audit.cli import main; main(['convert', '--from', {str(world / 'ours.pt')!r}, "
            f"'--to', {str(dest)!r}, '--format', 'zlab', '--force'])")
    _kill_mid_write(tmp_path, patch, call)
    assert tree_digest(dest) == before  # the old drafter, whole
    assert load_any(dest).spec.target_vocab_size > 0
    assert _leftovers(tmp_path) and all(name.startswith("z.tmp-") for name in _leftovers(tmp_path))

    assert main(["convert", "--from", str(world / "ours.pt"), "--to", str(dest), "--format", "zlab", "--force"]) == 0
    assert not (tmp_path / ".dflash-audit-tmp").exists()


def test_sigkill_during_a_checkpoint_save_keeps_the_previous_one(world, tmp_path):
    from impl.train import train_drafter

    out = tmp_path / "c.pt"
    run = dict(seq_len=48, block_size=4, max_anchors=4, target_layer_ids=[0, 1], batch_size=2, warmup=1, eval_sequences=0,
               progress=False)
    train_drafter(world / "target", TEXTS, out, steps=1, **run)
    saved = out.read_bytes()
    patch = "\n".join([
        "import torch",
        "real = torch.save",
        "def stalled(obj, f, *args, **kwargs):",
        "    real(obj, f, *args, **kwargs)",
        "    READY.touch()",
        "    time.sleep(600)",
        "torch.save = stalled",
    ])
    call = (f"from impl.train import train_drafter; train_drafter({str(world / 'target')!r}, {TEXTS!r}, "
            f"{str(out)!r}, steps=2, **{run!r})")
    _kill_mid_write(tmp_path, patch, call)
    assert out.read_bytes() == saved and load_checkpoint(out).step == 1
    assert _leftovers(tmp_path) and all(name.startswith("c.pt.tmp-") for name in _leftovers(tmp_path))

    train_drafter(world / "target", TEXTS, out, steps=1, **run)
    assert not (tmp_path / ".dflash-audit-tmp").exists()


def test_a_temp_folder_tidied_away_by_a_concurrent_writer_is_recreated(tmp_path, monkeypatch):
    """Two ranks writing beside each other: one's tidy may remove the shared temp folder between the
    other's mkdir and mkstemp. The write still lands (this was a CI flake under torchrun)."""
    import tempfile

    from foundation import atomic

    real = tempfile.mkstemp
    calls = []

    def racing(*args, **kwargs):
        if not calls:  # the first attempt finds the folder gone, as after another writer's tidy
            calls.append(1)
            (tmp_path / atomic.TMP_DIR).rmdir()
        return real(*args, **kwargs)

    monkeypatch.setattr(tempfile, "mkstemp", racing)
    atomic.atomic_write_bytes(tmp_path / "out.json", lambda tmp: open(tmp, "w").write("{}"))
    assert (tmp_path / "out.json").read_text() == "{}" and calls == [1]
    assert not (tmp_path / atomic.TMP_DIR).exists()

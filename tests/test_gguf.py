"""GGUF, the fourth format: drafters written by llama.cpp's own converter (b11434's convert_hf_to_gguf.py, through
the wrapper that settles only a plain byte-level pre-tokenizer's unknown hash) read back by `compare`: an f32 copy
audits clean against its source, a q8_0 copy is exit 0 with one `quantization` finding per quantized tensor; bad
GGUF files are one line and exit 2."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import pytest

from dflash_audit.cli import main
from serving_engines.live.llamacpp_env import source_tree

# Outside CI a checkout without `make setup` (the engine's tree in the cache) skips these; in CI a missing one fails.
pytestmark = pytest.mark.skipif(not (source_tree() / "convert_hf_to_gguf.py").is_file() and not os.environ.get("CI"),
                                reason="run `make setup` to unpack and build llama.cpp b11434")


@pytest.fixture(scope="module")
def ggufs(test_world, tmp_path_factory):
    from dflash_audit.conversion import convert
    from dflash_world.drafter import cached_test_drafter
    from serving_engines.live.llamacpp_convert import drafter_gguf

    root = tmp_path_factory.mktemp("gguf")
    convert(cached_test_drafter(test_world), root / "zlab", "zlab")
    notes = {}
    for quant in ("f32", "q8_0"):  # llama.cpp's converter, its file and notes kept per content (test_kept_answers.py)
        notes[quant] = drafter_gguf(root / "zlab", Path(test_world.target), root / f"drafter-{quant}.gguf", quant, None)
    return root, notes, test_world


def compare(tmp_path, ours, ref, target, *extra) -> tuple[int, dict]:
    out = tmp_path / "report.json"
    code = main(["compare", "--ours", str(ours), "--ref", str(ref), "--target", str(target), "--static-only",
                 "--out", str(tmp_path / "report"), "--json", str(out), *extra])
    return code, json.loads(out.read_text())


def test_the_converter_settles_only_the_byte_level_pre_tokenizer_and_says_so(ggufs):
    _, notes, _ = ggufs
    assert any("plain byte-level" in note and "'gpt-2'" in note for note in notes["f32"])


def test_an_f32_copy_audits_clean_against_its_source(ggufs, tmp_path):
    root, _, world = ggufs
    code, report = compare(tmp_path, root / "drafter-f32.gguf", root / "zlab", world.target, "--expect-identical")
    assert code == 0
    side = report["ours"]
    assert side["format"] == "gguf" and side["spec_complete"]
    assert side["gguf"]["type_counts"] == {"F32": 25} and not side["gguf"]["quantized"]
    assert side["gguf"]["target_layers_written"] == [2, 3, 4]  # the converter's +1 ...
    assert side["spec"]["target_layer_ids"] == [1, 2, 3]  # ... translated back
    assert "version not recorded" in side["gguf"]["converter"]
    assert side["spec"] == report["ref"]["spec"]
    assert [f for f in report["findings"] if f["component"] in ("weights", "quantization")] == []


def test_a_q8_0_copy_is_exit_0_with_a_quantization_finding_per_quantized_tensor(ggufs, tmp_path):
    root, _, world = ggufs
    code, report = compare(tmp_path, root / "drafter-q8_0.gguf", root / "zlab", world.target)
    assert code == 0
    quantized = report["ours"]["gguf"]["quantized"]
    assert quantized and set(quantized.values()) == {"Q8_0"}
    assert not any(name.endswith(("norm.weight",)) for name in quantized)  # norms stay F32
    found = {f["key"]: f for f in report["findings"] if f["component"] == "quantization"}
    assert set(found) == set(quantized)
    for name, finding in found.items():
        assert finding["severity"] == "info" and finding["raw"]["type"] == "Q8_0"
        assert 0 < finding["raw"]["relative_error"] < 0.02, (name, finding)
    assert not [f for f in report["findings"] if f["component"] == "weights" and f["key"] == "values"]


def rewrite(source: Path, destination: Path, edit) -> Path:
    data = bytearray(source.read_bytes())
    edit(data)
    destination.write_bytes(bytes(data))
    return destination


def non_drafter(path: Path) -> Path:
    from gguf import GGUFWriter
    import numpy as np

    writer = GGUFWriter(str(path), "qwen3")
    writer.add_block_count(1)
    writer.add_tensor("output_norm.weight", np.ones(4, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("verb", ["compare", "serve-check --live"])
@pytest.mark.parametrize("case, words", [
    ("truncated", "truncated or corrupt GGUF"),
    ("magic", "not a GGUF file"),
    ("tensor_count", "more than its"),
    ("string", "a string of"),
    ("non_drafter", "not a DFlash drafter"),
])
def test_a_bad_gguf_is_one_line_and_exit_2(ggufs, tmp_path, capsys, case, words, verb):
    root, _, world = ggufs
    good = root / "drafter-f32.gguf"
    bad = tmp_path / "bad.gguf"
    if case == "truncated":
        bad.write_bytes(good.read_bytes()[:2000])
    elif case == "magic":
        rewrite(good, bad, lambda d: d.__setitem__(slice(0, 4), b"GGUX"))
    elif case == "tensor_count":
        rewrite(good, bad, lambda d: d.__setitem__(slice(8, 16), struct.pack("<Q", 1 << 60)))
    elif case == "string":  # the first key's name length
        rewrite(good, bad, lambda d: d.__setitem__(slice(24, 32), struct.pack("<Q", 1 << 40)))
    else:
        non_drafter(bad)
    capsys.readouterr()
    if verb == "compare":
        code = main(["compare", "--ours", str(bad), "--ref", str(root / "zlab"), "--static-only",
                     "--out", str(tmp_path / "report")])
    else:  # refused before any engine starts
        code = main(["serve-check", "--drafter", str(bad), "--engine", "llamacpp", "--target", str(world.target),
                     "--live", "--json", str(tmp_path / "serving.json")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and not (tmp_path / "serving.json").exists()
    assert len(err.splitlines()) == 1 and err.startswith("dflash-audit: error: ") and str(bad) in err, err
    assert words in err, err

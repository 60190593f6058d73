"""Class 14, the readers of the newest verbs, given what a hostile user writes: GGUF metadata of the wrong kind (a
string where layer ids belong, a string block count, a float head count), a drafter GGUF compared without its target,
chat templates that raise as they render (role order, `raise_exception`) or that the sandbox stops, data-check datasets
whose names are not UTF-8, speculators tables whose columns hold strings, one file that is not a record, compressed
bombs and inputs nested past any parser. Each refusal is exit 2 and one `dflash-audit: error:` line naming the file,
flag or key (never the catch-all); a valid dataset under a name that is not UTF-8 gets the verdict its UTF-8 twin gets,
the name shown escaped in every report."""

from __future__ import annotations

import gzip
import io
import json
import os
import shutil
import tarfile
import zipfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.bad_inputs.cli_run import assert_refused, run, tree_digest

MIB = 1 << 20
BOMB_BYTES = 72 * MIB  # zeros: past foundation.decompression's 64 MiB floor, a few hundred KiB compressed


def bytes_name(folder: Path, name: bytes) -> Path:
    """`folder / name` for a name that is not UTF-8 (any bytes are a Linux file name)."""
    return Path(os.fsdecode(os.fsencode(folder) + b"/" + name))


# -- GGUF metadata ---------------------------------------------------------------------------------------------------
def gguf_keys(world: Path) -> dict:
    """The keys llama.cpp's converter writes for the world's z-lab drafter (zref), from its config.json."""
    config = json.loads((world / "zref" / "config.json").read_text())
    dflash = config["dflash_config"]
    return {"dflash.block_count": config["num_hidden_layers"], "dflash.embedding_length": config["hidden_size"],
            "dflash.feed_forward_length": config["intermediate_size"],
            "dflash.attention.head_count": config["num_attention_heads"],
            "dflash.attention.head_count_kv": config["num_key_value_heads"],
            "dflash.attention.key_length": config["head_dim"],
            "dflash.attention.layer_norm_rms_epsilon": config["rms_norm_eps"],
            "dflash.context_length": config["max_position_embeddings"],
            "dflash.rope.freq_base": config["rope_parameters"]["rope_theta"], "dflash.block_size": dflash["block_size"],
            "dflash.target_layers": [i + 1 for i in dflash["target_layer_ids"]],
            "tokenizer.ggml.mask_token_id": dflash["mask_token_id"],
            "tokenizer.ggml.tokens": [f"t{i}" for i in range(config["vocab_size"])]}


def write_gguf(path: Path, world: Path, **changes) -> Path:
    """The world's z-lab drafter as a GGUF (gguf's GGUFWriter, the converter's own writer), with `changes` made to
    its keys (a key set to None is left out), each written with the GGUF type its Python value takes."""
    from gguf import GGUFWriter

    from dflash_audit.formats.gguf_file import BLOCK_NAMES, TOP_NAMES

    top = {ours: theirs for theirs, ours in TOP_NAMES.items()}
    block = {ours: theirs for theirs, ours in BLOCK_NAMES.items()}
    writer = GGUFWriter(str(path), "dflash")
    for key, value in {**gguf_keys(world), **{k.replace("__", "."): v for k, v in changes.items()}}.items():
        if value is None:
            continue
        if isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value) if value >= 0 else writer.add_int32(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)
        else:
            writer.add_array(key, value)
    for name, tensor in load_file(str(world / "zref" / "model.safetensors")).items():
        layer, _, rest = name.removeprefix("layers.").partition(".")
        writer.add_tensor(top.get(name) or f"blk.{layer}.{block[rest]}", tensor.numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def compare_gguf(world: Path, gguf: Path, tmp_path: Path, target: Path | None = None) -> list:
    return ["compare", "--ours", gguf, "--ref", world / "zref", "--target", target or world / "target",
            "--static-only", "--out", tmp_path / "report"]


# name -> (key changes (dots written as __), the key the refusal names, words it says)
GGUF_KINDS = {
    "layer ids a string": ({"dflash__target_layers": "1,2"}, "dflash.target_layers", "a string"),
    "layer ids of floats": ({"dflash__target_layers": [1.5, 2.5]}, "dflash.target_layers", "floats"),
    "layer ids of strings": ({"dflash__target_layers": ["a", "b"]}, "dflash.target_layers", "strings"),
    "block count a string": ({"dflash__block_count": "one"}, "dflash.block_count", "a positive integer"),
    "block count zero": ({"dflash__block_count": 0}, "dflash.block_count", "a positive integer"),
    "head count a float": ({"dflash__attention__head_count": 4.0}, "dflash.attention.head_count", "a float"),
    "block size negative": ({"dflash__block_size": -3}, "dflash.block_size", "a positive integer"),
    "epsilon a string": ({"dflash__attention__layer_norm_rms_epsilon": "tiny"},
                         "dflash.attention.layer_norm_rms_epsilon", "a number"),
    "rope base an array": ({"dflash__rope__freq_base": [10000.0]}, "dflash.rope.freq_base", "a number"),
    "window pattern an integer": ({"dflash__attention__sliding_window": 8,
                                   "dflash__attention__sliding_window_pattern": 3},
                                  "dflash.attention.sliding_window_pattern", "one per layer"),
    "causal a string": ({"dflash__attention__causal": "yes"}, "dflash.attention.causal", "true or false"),
    "token table a string": ({"tokenizer__ggml__tokens": "abc"}, "tokenizer.ggml.tokens", "an array of strings"),
    "mask token a string": ({"tokenizer__ggml__mask_token_id": "x"}, "tokenizer.ggml.mask_token_id", "an integer"),
    "hidden size missing": ({"dflash__embedding_length": None}, "dflash.embedding_length", "missing"),
}


@pytest.fixture(scope="module")
def sound_gguf(world, tmp_path_factory) -> Path:
    return write_gguf(tmp_path_factory.mktemp("gguf") / "drafter.gguf", world)


def test_the_sound_gguf_compares_clean(world, sound_gguf, tmp_path, capsys):
    """The control: the same writer without a change is read and matches its source (the guard refuses nothing
    the converter writes)."""
    code, out, err = run(compare_gguf(world, sound_gguf, tmp_path), capsys)
    assert code == 0 and "error" not in err, err
    assert "0 divergences" in out


@pytest.mark.parametrize("case", sorted(GGUF_KINDS))
def test_gguf_metadata_of_the_wrong_kind_names_the_file_and_the_key(world, tmp_path, capsys, case):
    changes, key, words = GGUF_KINDS[case]
    gguf = write_gguf(tmp_path / "drafter.gguf", world, **changes)
    code, _, err = run(compare_gguf(world, gguf, tmp_path), capsys)
    assert_refused(code, err, gguf, repr(key), words)
    assert not (tmp_path / "report").exists()


@pytest.mark.parametrize("verb", ["serve-check", "eval", "convert"])
def test_every_verb_reading_a_gguf_meets_the_same_guard(world, tmp_path, capsys, verb):
    gguf = write_gguf(tmp_path / "drafter.gguf", world, dflash__target_layers="1,2")
    argv = {"serve-check": ["serve-check", "--drafter", gguf, "--engine", "llamacpp", "--target", world / "target",
                            "--json", tmp_path / "serving.json"],
            "eval": ["eval", "--drafter", gguf, "--target", world / "target", "--prompts", world / "prompts.jsonl",
                     "--max-new-tokens", "2"],
            "convert": ["convert", "--from", gguf, "--to", tmp_path / "converted", "--format", "zlab",
                        "--target", world / "target"]}[verb]
    code, _, err = run(argv, capsys)
    assert_refused(code, err, gguf, "'dflash.target_layers'")


def target_gguf(path: Path, block_count) -> Path:
    """A target GGUF (architecture qwen3) whose block_count is `block_count` (None: absent)."""
    import numpy as np
    from gguf import GGUFWriter

    writer = GGUFWriter(str(path), "qwen3")
    if isinstance(block_count, str):
        writer.add_string("qwen3.block_count", block_count)
    elif isinstance(block_count, float):
        writer.add_float32("qwen3.block_count", block_count)
    elif block_count is not None:
        writer.add_uint32("qwen3.block_count", block_count)
    writer.add_tensor("output_norm.weight", np.ones(4, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("block_count, words", [("two", "a string"), (2.0, "a float"), (0, "a positive integer"),
                                                (None, "absent")])
def test_a_target_gguf_of_the_wrong_kind_names_the_target_and_its_key(world, sound_gguf, tmp_path, capsys,
                                                                      block_count, words):
    target = target_gguf(tmp_path / "target.gguf", block_count)
    code, _, err = run(["convert", "--from", sound_gguf, "--to", tmp_path / "converted", "--format", "zlab",
                        "--target", target], capsys)
    assert_refused(code, err, target, "'qwen3.block_count'", words)
    assert not (tmp_path / "converted").exists()


@pytest.mark.parametrize("verb", ["compare", "convert", "serve-check"])
def test_a_gguf_drafter_without_its_target_is_told_to_give_it(world, sound_gguf, tmp_path, capsys, verb):
    """A GGUF drafter does not record its target's depth: the line asks for --target, never "missing from
    config.json" (there is no config.json)."""
    argv = {"compare": ["compare", "--ours", sound_gguf, "--ref", world / "zref", "--static-only", "--out",
                        tmp_path / "report"],
            "convert": ["convert", "--from", sound_gguf, "--to", tmp_path / "converted", "--format", "zlab"],
            "serve-check": ["serve-check", "--drafter", sound_gguf, "--engine", "llamacpp", "--json",
                            tmp_path / "serving.json"]}[verb]
    code, _, err = run(argv, capsys)
    line = assert_refused(code, err, sound_gguf, "--target", "target's depth")
    assert "config.json" not in line


def test_gguf_arrays_nested_past_any_reader_name_the_file(tmp_path, world, capsys):
    """A key holding arrays of arrays 100,000 deep (a few MB): gguf's reader recurses per level."""
    import struct

    def key(name: bytes, kind: int) -> bytes:
        return struct.pack("<Q", len(name)) + name + struct.pack("<I", kind)

    body = key(b"general.architecture", 8) + struct.pack("<Q", 6) + b"dflash" + key(b"dflash.deep", 9)
    body += struct.pack("<IQ", 9, 1) * 99_999 + struct.pack("<IQ", 4, 1) + struct.pack("<I", 7)
    gguf = tmp_path / "deep.gguf"
    gguf.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 2) + body + b"\0" * 64)
    code, _, err = run(compare_gguf(world, gguf, tmp_path), capsys)
    assert_refused(code, err, gguf, "'dflash.deep'", "nested deeper")


# -- chat templates that fail as they render -------------------------------------------------------------------------
TEMPLATES = {  # name -> (template text, what the line says, the template line named)
    "system turn required": ("{% if messages[0]['role'] != 'system' %}\n"
                             "{{ raise_exception('Conversation roles must start with a system turn') }}\n"
                             "{% endif %}{{ messages[0]['content'] }}", "must start with a system turn", 2),
    "roles must alternate": ("{% for message in messages %}\n{% if (message['role'] == 'user') != "
                             "(loop.index0 % 2 == 1) %}\n{{ raise_exception('Conversation roles must alternate "
                             "user/assistant/user/assistant/...') }}\n{% endif %}{{ message['content'] }}"
                             "{% endfor %}", "roles must alternate", 3),
    "sandbox range": ("{% for i in range(10 ** 9) %}x{% endfor %}{{ messages[0]['content'] }}",
                      "MAX_RANGE", 1),
    "sandbox unsafe attribute": ("{{ messages.__class__.__mro__ }}", "unsafe", 1),
    "endless recursion": ("{% macro again(n) %}{{ again(n) }}{% endmacro %}{{ again(1) }}", "recursion", 1),
    "type error": ("{{ messages[0]['content'] + 1 }}", "concatenate", 1),
    "undefined element": ("{{ messages[5]['content'] }}", "no element 5", 1),
}


@pytest.mark.parametrize("case", sorted(TEMPLATES))
def test_a_chat_template_failing_as_it_renders_names_the_template(world, tmp_path, capsys, case):
    text, words, line = TEMPLATES[case]
    template = tmp_path / "chat.jinja"
    template.write_text(text)
    code, _, err = run(["eval", "--drafter", world / "ours.pt", "--target", world / "target", "--prompts",
                        world / "prompts.jsonl", "--max-new-tokens", "2", "--chat-template", template], capsys)
    assert_refused(code, err, f"--chat-template {template}", words, f"at its line {line}")


def test_the_same_template_through_compare_names_it_too(world, tmp_path, capsys):
    template = tmp_path / "chat.jinja"
    template.write_text(TEMPLATES["roles must alternate"][0])
    code, _, err = run(["compare", "--ours", world / "ours.pt", "--ref", world / "zref", "--target", world / "target",
                        "--prompts", world / "prompts.jsonl", "--max-new-tokens", "2", "--chat-template", template,
                        "--out", tmp_path / "report"], capsys)
    assert_refused(code, err, f"--chat-template {template}", "roles must alternate")
    assert not (tmp_path / "report").exists()


# -- data-check: names that are not UTF-8 ----------------------------------------------------------------------------
def config(world: Path) -> dict:
    return json.loads((world / "target" / "config.json").read_text())


def vllm_record(world: Path, tokens: int = 12) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {"hidden_states": torch.randn(tokens, 2, config(world)["hidden_size"]),
            "token_ids": torch.arange(tokens) % 50}


def specforge_record(world: Path, tokens: int = 12) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {"input_ids": torch.arange(tokens) % 50, "loss_mask": torch.ones(tokens),
            "hidden_states": torch.randn(tokens, 2 * config(world)["hidden_size"])}


def data_check(dataset, world: Path, out: Path, ids: str = "1,2") -> list:
    return ["data-check", dataset, "--target", world / "target", "--out", out, "--layer-ids", ids]


def verdict(out: Path) -> tuple[int, list]:
    report = json.loads((out / "report.json").read_text())
    return report["exit_status"], sorted((f["key"], f["records"]) for f in report["findings"])


# name -> (the folder (under tmp) and the record name, both bytes; a SpecForge record or a vLLM one)
ODD_NAMES = {"record named \\xff": (b"dataset", b"\xff.safetensors"),
             "folder named \\xfe": (b"ds\xfe", b"hs_0.safetensors"),
             "specforge record named \\xe9": (b"dataset", b"data_\xe9.ckpt"),
             "record and folder both": (b"d\xe9\xff", b"r\xfe.safetensors")}


@pytest.mark.parametrize("case", sorted(ODD_NAMES))
def test_a_dataset_whose_names_are_not_utf8_gets_its_twins_verdict(world, tmp_path, capsys, case):
    folder_name, record_name = ODD_NAMES[case]
    verdicts = []
    for twin, (folder_bytes, record_bytes) in (("odd", (folder_name, record_name)),
                                               ("plain", (b"plain", record_name.decode("latin-1").encode("ascii",
                                                                                                         "replace")))):
        root = tmp_path / twin
        root.mkdir()
        folder = bytes_name(root, folder_bytes)
        os.mkdir(folder)
        record = bytes_name(folder, record_bytes)
        if record_bytes.endswith(b".ckpt"):
            torch.save(specforge_record(world), record)
        else:
            save_file(vllm_record(world), str(record))
        ids = "0,1" if record_bytes.endswith(b".ckpt") else "1,2"
        code, _, err = run(data_check(folder, world, root / "report", ids), capsys)
        assert code in (0, 1) and "error" not in err, err
        verdicts.append((code, verdict(root / "report")))
    (odd_code, (odd_status, odd_findings)), (plain_code, (plain_status, plain_findings)) = verdicts
    assert odd_code == plain_code == odd_status == plain_status
    assert [key for key, _ in odd_findings] == [key for key, _ in plain_findings]
    shown = os.fsencode(record_name).decode("utf-8", "backslashreplace")  # b"\xff.x" -> "\\xff.x"
    report = json.loads((tmp_path / "odd" / "report" / "report.json").read_text())
    assert [r["record"] for r in report["records"]] == [shown]
    assert "\\x" in report["facts"]["dataset"] or folder_name.isascii()
    assert shown in (tmp_path / "odd" / "report" / "index.html").read_text(encoding="utf-8")


def test_one_record_given_by_a_name_that_is_not_utf8(world, tmp_path, capsys):
    record = bytes_name(tmp_path, b"\xff.safetensors")
    save_file(vllm_record(world), str(record))
    code, _, err = run(data_check(record, world, tmp_path / "report"), capsys)
    assert code in (0, 1) and "error" not in err, err
    assert json.loads((tmp_path / "report" / "report.json").read_text())["records"][0]["record"] == "\\xff.safetensors"


@pytest.mark.parametrize("name", [b"\xff.safetensors", b"data_\xe9.ckpt"])
def test_a_broken_record_whose_name_is_not_utf8_is_named_escaped(world, tmp_path, capsys, name):
    folder = tmp_path / "dataset"
    folder.mkdir()
    bytes_name(folder, name).write_bytes(b"\xff" * 64)
    before = tree_digest(tmp_path)
    code, _, err = run(data_check(folder, world, tmp_path / "report", "0,1" if name.endswith(b".ckpt") else "1,2"),
                       capsys)
    assert_refused(code, err, name.decode("utf-8", "backslashreplace"))
    assert tree_digest(tmp_path) == before


# -- data-check: speculators' table of the wrong kind ----------------------------------------------------------------
def speculators_dataset(folder: Path, world: Path, table: dict) -> Path:
    """speculators' output folder: hidden_states/hs_0.safetensors beside the preprocessed `datasets` table."""
    from datasets import Dataset

    (folder / "hidden_states").mkdir(parents=True)
    save_file(vllm_record(world), str(folder / "hidden_states" / "hs_0.safetensors"))
    Dataset.from_dict(table).save_to_disk(str(folder.parent / "table"))
    for entry in (folder.parent / "table").iterdir():
        entry.rename(folder / entry.name)
    (folder.parent / "table").rmdir()
    return folder


IDS = [i % 50 for i in range(12)]
SPECULATORS_TABLES = {  # name -> (table, the column named, what the line says)
    "ids as text": ({"input_ids": ["0 1 2 3"], "loss_mask": [[1] * 12]}, "input_ids", "a string"),
    "mask as text": ({"input_ids": [IDS], "loss_mask": ["1" * 12]}, "loss_mask", "a string"),
    "ids as lists of text": ({"input_ids": [[str(i) for i in IDS]], "loss_mask": [[1] * 12]}, "input_ids",
                             "a list of strings"),
    "ids as one integer": ({"input_ids": [5], "loss_mask": [[1] * 12]}, "input_ids", "an integer"),
    "ids nested": ({"input_ids": [[IDS]], "loss_mask": [[1] * 12]}, "input_ids", "a list of lists of integers"),
    "ids all null": ({"input_ids": [None], "loss_mask": [[1] * 12]}, "input_ids", "a null"),
    "a null row": ({"input_ids": [None, IDS], "loss_mask": [[1] * 12, [1] * 12]}, "input_ids", "a null in row 0"),
    "a null id": ({"input_ids": [IDS[:-1] + [None]], "loss_mask": [[1] * 12]}, "input_ids", "a null in row 0"),
}


@pytest.mark.parametrize("case", sorted(SPECULATORS_TABLES))
def test_a_speculators_table_of_the_wrong_kind_names_the_column(world, tmp_path, capsys, case):
    table, column, words = SPECULATORS_TABLES[case]
    folder = speculators_dataset(tmp_path / "speculators", world, table)
    capsys.readouterr()  # datasets' progress bar as the table was saved
    before = tree_digest(tmp_path)
    code, _, err = run(data_check(folder, world, tmp_path / "report"), capsys)
    assert_refused(code, err, folder, repr(column), words)
    assert tree_digest(tmp_path) == before


# -- data-check: one file that is not a record -----------------------------------------------------------------------
def not_records(world: Path, root: Path) -> dict[str, tuple[Path, str]]:
    (root / "notes.txt").write_text("my notes\n")
    (root / "config.json").write_text("{}\n")
    torch.save({"model": {"w": torch.zeros(2)}}, root / "model.pt")
    shutil.copy(world / "zref" / "model.safetensors", root / "drafter.safetensors")
    odd = bytes_name(root, b"\xff.txt")
    odd.write_text("x\n")
    return {"a text file": (root / "notes.txt", "not a hidden-state record"),
            "a JSON file": (root / "config.json", "not a hidden-state record"),
            "a torch checkpoint": (root / "model.pt", "not a hidden-state record"),
            "a drafter's safetensors": (root / "drafter.safetensors", "'hidden_states'"),
            "a text file named \\xff": (odd, "not a hidden-state record")}


@pytest.mark.parametrize("case", ["a text file", "a JSON file", "a torch checkpoint", "a drafter's safetensors",
                                  "a text file named \\xff"])
def test_one_file_that_is_not_a_record_is_named(world, tmp_path, capsys, case):
    path, words = not_records(world, tmp_path)[case]
    before = tree_digest(tmp_path)
    code, _, err = run(data_check(path, world, tmp_path / "report"), capsys)
    shown = os.fsencode(path).decode("utf-8", "backslashreplace")
    assert_refused(code, err, shown, words)
    assert tree_digest(tmp_path) == before


# -- compressed bombs ------------------------------------------------------------------------------------------------
def zeros(stream, size: int) -> None:
    chunk = bytes(8 * MIB)
    for _ in range(size // len(chunk)):
        stream.write(chunk)


def deflated_torch_file(path: Path, size: int) -> Path:
    """A torch checkpoint whose zip holds, deflated, an entry of `size` zero bytes (torch's reader inflates it)."""
    plain = io.BytesIO()
    torch.save({"input_ids": torch.arange(4)}, plain)
    with zipfile.ZipFile(io.BytesIO(plain.getvalue())) as source, \
            zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED, compresslevel=1) as bomb:
        for entry in source.infolist():
            bomb.writestr(entry.filename, source.read(entry.filename))
        with bomb.open(source.infolist()[0].filename.split("/")[0] + "/data/9", "w") as stream:
            zeros(stream, size)
    return path


def gzipped_nemo(path: Path, size: int) -> Path:
    """A .nemo archive (a gzipped tar) whose model_weights.ckpt is `size` zero bytes."""
    member = tarfile.TarInfo("model_weights.ckpt")
    member.size = size
    with tarfile.open(path, "w:gz", compresslevel=1) as archive:
        archive.addfile(member, io.BytesIO(bytes(size)))
    return path


def test_a_gzipped_record_bomb_is_refused_with_its_sizes(world, tmp_path, capsys):
    folder = tmp_path / "dataset"
    folder.mkdir()
    with gzip.open(folder / "data_0.ckpt.gz", "wb", compresslevel=1) as stream:
        zeros(stream, BOMB_BYTES)
    size = (folder / "data_0.ckpt.gz").stat().st_size
    code, _, err = run(data_check(folder, world, tmp_path / "report", "0,1"), capsys)
    assert_refused(code, err, folder / "data_0.ckpt.gz", "decompression bomb", f"{size:,} bytes", "67,108,864")


def test_a_zip_bomb_record_is_refused_by_its_directory(world, tmp_path, capsys):
    folder = tmp_path / "dataset"
    folder.mkdir()
    record = deflated_torch_file(folder / "data_0.ckpt", BOMB_BYTES)
    code, _, err = run(data_check(folder, world, tmp_path / "report", "0,1"), capsys)
    assert_refused(code, err, record, "decompression bomb", f"{record.stat().st_size:,} bytes")


@pytest.mark.parametrize("kind", ["pt", "nemo"])
def test_a_drafter_bomb_is_refused_with_its_sizes(world, tmp_path, capsys, kind):
    bomb = (deflated_torch_file(tmp_path / "bomb.pt", BOMB_BYTES) if kind == "pt"
            else gzipped_nemo(tmp_path / "bomb.nemo", BOMB_BYTES))
    code, _, err = run(["compare", "--ours", bomb, "--ref", world / "zref", "--static-only", "--out",
                        tmp_path / "report"], capsys)
    assert_refused(code, err, bomb, "decompression bomb", f"{bomb.stat().st_size:,} bytes")
    assert not list(tmp_path.glob("report*"))


# -- deep nesting ----------------------------------------------------------------------------------------------------
def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


@pytest.mark.parametrize("depth", [300, 100_000])
def test_deep_json_is_named_where_it_is_read(world, tmp_path, capsys, depth):
    """JSON nested past 200 levels: past Python's parser (100,000), or parsed and then too deep for any walk
    over it (300), refused naming the file."""
    rows = tmp_path / "rows.json"
    rows.write_text(nested(depth))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"id": "a", "prompt": "x", "notes": %s}\n' % nested(depth))
    target = tmp_path / "target"
    shutil.copytree(world / "target", target)
    (target / "config.json").write_text(json.dumps(config(world))[:-1] + ', "notes": %s}' % nested(depth))
    evaluate = ["eval", "--drafter", world / "ours.pt", "--max-new-tokens", "2"]
    for argv, named in ((evaluate + ["--target", world / "target", "--prompts", f"gsm8k:{rows}"], rows),
                        (evaluate + ["--target", world / "target", "--prompts", prompts], f"{prompts}:1"),
                        (evaluate + ["--target", target, "--prompts", world / "prompts.jsonl"],
                         target / "config.json")):
        code, _, err = run(argv, capsys)
        assert_refused(code, err, named, "nested")


def test_an_existing_json_output_nested_past_the_stack_is_kept(world, tmp_path, capsys):
    """--json naming a user's file of JSON nested 100,000 deep: someone else's file, kept (not the catch-all)."""
    mine = tmp_path / "mine.json"
    mine.write_text('{"a": %s}' % nested(100_000))
    before = tree_digest(tmp_path)
    code, _, err = run(["eval", "--drafter", world / "ours.pt", "--target", world / "target", "--prompts",
                        world / "prompts.jsonl", "--max-new-tokens", "2", "--json", mine], capsys)
    assert_refused(code, err, f"--json {mine}", "not written by dflash-audit")
    assert tree_digest(tmp_path) == before

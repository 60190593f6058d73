"""What the tool keeps in its cache root so that no process pays twice for the same answer: the vLLM environment's
probe (`serving_engines/live/vllm_env.py`: importing vLLM takes a CPU engine 15-25 s), the engine-reads scan of
a source file (`serving_engines/config_reads.py`: seconds per engine) and a drafter's GGUF by llama.cpp's converter
(`serving_engines/live/llamacpp_convert.py`: seconds on a tiny drafter, minutes on a real one). Each is kept under
what it depends on, and is made again when that changes: never a stale answer."""

from __future__ import annotations

import json
import os

import pytest

from serving_engines.live.llamacpp_env import source_tree

# Outside CI a checkout without `make setup` has no llama.cpp tree; in CI (which runs `make setup`) it must be there.
LLAMACPP_TREE = (source_tree() / "convert_hf_to_gguf.py").is_file() or bool(os.environ.get("CI"))


@pytest.fixture
def cache_root(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache" / "dflash-audit"


def fake_python(path, identity: str, probes):
    """A program that answers as a Python with vLLM: the identity question (its `site` import tells it apart) with
    `identity`, the import probe with a version, each probe noted in `probes`."""
    answer = json.dumps({"version": "0.32.0", "root": "/nonexistent/vllm", "cuda": False})
    path.write_text("#!/bin/sh\n"
                    "case \"$2\" in\n"
                    f"  *getsitepackages*) echo '{json.dumps({'identity': ['py', '/v/__init__.py', identity]})}' ;;\n"
                    f"  *) echo probed >> {probes}; echo '{answer}' ;;\n"
                    "esac\n")
    path.chmod(0o755)
    return path


def test_the_vllm_probe_is_asked_once_per_identity(tmp_path, cache_root):
    from serving_engines.live.vllm_env import find_vllm

    probes = tmp_path / "probes"
    python = fake_python(tmp_path / "python", "site folders as installed", probes)
    first = find_vllm(python)
    assert (first.version, first.package_root, first.python) == ("0.32.0", "/nonexistent/vllm", str(python))
    assert find_vllm(python) == first
    assert probes.read_text().count("probed") == 1, "the kept answer was not used"
    assert len(list((cache_root / "vllm-probes").glob("*.json"))) == 1
    fake_python(python, "a package installed since", probes)  # a site folder's mtime moved: asked again
    assert find_vllm(python) == first
    assert probes.read_text().count("probed") == 2


def test_a_python_whose_identity_cannot_be_told_is_probed_every_time_and_nothing_is_kept(tmp_path, cache_root):
    from serving_engines.live.vllm_env import find_vllm

    probes = tmp_path / "probes"
    python = tmp_path / "python"
    answer = json.dumps({"version": "0.32.0", "root": "/nonexistent/vllm", "cuda": False})
    python.write_text(f"#!/bin/sh\necho probed >> {probes}\necho '{answer}'\n")  # answers every question alike
    python.chmod(0o755)
    for _ in range(2):
        assert find_vllm(python).version == "0.32.0"
    assert probes.read_text().count("probed") == 4  # the identity question and the probe, twice
    assert not (cache_root / "vllm-probes").exists()


def test_an_engine_file_is_scanned_once_per_text_and_scanner(tmp_path, cache_root, monkeypatch):
    from serving_engines import config_reads

    source = tmp_path / "dflash.py"
    source.write_text("class DFlashModel:\n    def __init__(self, config):\n"
                      "        self.scale = getattr(config, 'logit_scale', 1.0)\n")
    reads, weights = config_reads.scan_file(source, "engine/dflash.py")
    assert [(r.key, r.how, r.default, r.place) for r in reads] == [("logit_scale", "getattr", "1.0",
                                                                   "engine/dflash.py:3")]
    assert len(list((cache_root / "config-reads").glob("*.json"))) == 1

    class Unreachable:
        def __init__(self, *args):
            raise AssertionError("scanned again though its text and the scanner are unchanged")

    with monkeypatch.context() as patches:
        patches.setattr(config_reads, "_Scanner", Unreachable)
        assert config_reads.scan_file(source, "engine/dflash.py") == (reads, weights)
    source.write_text(source.read_text().replace("logit_scale", "logit_softcap"))  # a new release of the file
    assert [r.key for r in config_reads.scan_file(source, "engine/dflash.py")[0]] == ["logit_softcap"]
    with monkeypatch.context() as patches:  # another version of the scanner keeps its own scans
        patches.setattr(config_reads, "_scanner_digest", lambda: "another scanner")
        assert [r.key for r in config_reads.scan_file(source, "engine/dflash.py")[0]] == ["logit_softcap"]
    assert len(list((cache_root / "config-reads").glob("*.json"))) == 3


@pytest.mark.skipif(not LLAMACPP_TREE, reason="run `make setup` to build llama.cpp")
def test_a_drafter_gguf_is_converted_once_per_content(test_world, tmp_path, monkeypatch):
    """llama.cpp's converter runs once for a drafter's bytes (whatever folder holds them); a drafter that differs by
    a byte is converted anew; each copy is the converted file, with the notes its conversion earned."""
    import shutil

    from dflash_audit.conversion import convert
    from dflash_world.drafter import cached_full_drafter
    from serving_engines.live import llamacpp_convert
    from serving_engines.live.llamacpp_env import engine_dir

    cache = tmp_path / "cache"  # the pinned tree, seen from a cache root of this test's own
    engine_dir(cache).mkdir(parents=True)
    (engine_dir(cache) / "llama.cpp").symlink_to(source_tree())
    runs = []
    real = llamacpp_convert.run_converter
    monkeypatch.setattr(llamacpp_convert, "run_converter", lambda *a, **k: runs.append(a[0]) or real(*a, **k))
    first, moved, changed = tmp_path / "zlab", tmp_path / "elsewhere" / "zlab", tmp_path / "changed"
    convert(cached_full_drafter(test_world), first, "zlab")
    shutil.copytree(first, moved)
    shutil.copytree(first, changed)
    (changed / "config.json").write_text((changed / "config.json").read_text() + "\n")
    made = {}
    for name, folder in (("first", first), ("moved", moved), ("changed", changed)):
        made[name] = (llamacpp_convert.drafter_gguf(folder, test_world.target, tmp_path / f"{name}.gguf", "f32", None,
                                                    cache), (tmp_path / f"{name}.gguf").read_bytes())
    assert runs == [first, changed]
    assert len(list((engine_dir(cache) / "drafters").iterdir())) == 2
    assert made["first"] == made["moved"] and made["first"][1][:4] == b"GGUF"
    assert made["changed"][0] == made["first"][0]  # the same notes (the settled pre-tokenizer)
    assert not list(tmp_path.glob(".*.partial"))


def test_the_kept_drafters_are_pruned_to_the_most_recently_used(tmp_path):
    from serving_engines.live.llamacpp_convert import DRAFTER_FILE, DRAFTER_NOTES, KEPT_DRAFTERS, prune_kept

    entries = []
    for age in range(KEPT_DRAFTERS + 3):
        entry = tmp_path / f"entry-{age}"
        entry.mkdir()
        (entry / DRAFTER_FILE).write_bytes(b"GGUF")
        (entry / DRAFTER_NOTES).write_text("[]")
        os.utime(entry / DRAFTER_FILE, (1000 - age, 1000 - age))  # entry-0 the most recently used
        entries.append(entry)
    (tmp_path / "a user's folder").mkdir()  # not an entry: never touched
    removed = prune_kept(tmp_path, entries[-1], (DRAFTER_FILE, DRAFTER_NOTES), KEPT_DRAFTERS)
    assert sorted(removed) == sorted(entries[KEPT_DRAFTERS - 1:-1])
    assert sorted(p for p in tmp_path.iterdir()) == sorted([*entries[:KEPT_DRAFTERS - 1], entries[-1],
                                                            tmp_path / "a user's folder"])


def test_the_kept_drafters_are_pruned_to_a_byte_budget_too(tmp_path):
    """Within the count, the newest entries are kept while their files and the one in use fit the budget: a few real
    drafters' GGUFs (gigabytes each) never fill the disk as 32 small ones may."""
    from serving_engines.live.llamacpp_convert import DRAFTER_FILE, DRAFTER_NOTES, prune_kept

    entries = []
    for age in range(6):
        entry = tmp_path / f"entry-{age}"
        entry.mkdir()
        (entry / DRAFTER_FILE).write_bytes(b"G" * 100)
        (entry / DRAFTER_NOTES).write_text("[]")
        os.utime(entry / DRAFTER_FILE, (1000 - age, 1000 - age))  # entry-0 the most recently used
        entries.append(entry)
    in_use = entries[-1]  # the oldest by time, in use now: always kept, and counted in the budget
    each = 100 + len("[]")
    removed = prune_kept(tmp_path, in_use, (DRAFTER_FILE, DRAFTER_NOTES), 32, max_bytes=3 * each)
    assert sorted(removed) == sorted(entries[2:-1])  # the one in use, then entry-0 and entry-1: three entries' bytes
    assert sorted(tmp_path.iterdir()) == sorted([entries[0], entries[1], in_use])
    assert sorted(prune_kept(tmp_path, in_use, (DRAFTER_FILE, DRAFTER_NOTES), 32, max_bytes=10)) == entries[:2]

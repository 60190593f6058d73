"""What the tool keeps in its cache root so that no process pays twice for the same answer: the vLLM environment's
probe (`serving_engines/live/vllm_env.py`: importing vLLM takes a CPU engine 15-25 s) and the engine-reads scan of
a source file (`serving_engines/config_reads.py`: seconds per engine). Each is kept under what it depends on, and is
asked again when that changes: never a stale answer."""

from __future__ import annotations

import json

import pytest


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

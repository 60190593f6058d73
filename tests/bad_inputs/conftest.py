"""The hostile-input suites, one file per class of issue #32 (outputs kept, verdicts, bombs, internal names,
messages that name the right thing, valid layouts) and the fuzz: one input world per session."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.test_bad_inputs import build_world

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def world(tmp_path_factory) -> Path:
    return build_world(tmp_path_factory.mktemp("hostile"))


@pytest.fixture(scope="session")
def gguf_world(llamacpp_full_gguf, test_world, tmp_path_factory) -> Path:
    """The gguf fuzz reader's inputs: the test drafter as llama.cpp's converter writes it (the session's one
    conversion, shared with the llama.cpp tests), its source `ckpt.pt`, the target and one prompt."""
    from dflash_world.drafter import cached_full_drafter

    root = tmp_path_factory.mktemp("gguf-world")
    shutil.copy(llamacpp_full_gguf, root / "drafter.gguf")
    (root / "ref.pt").symlink_to(cached_full_drafter(test_world))
    (root / "target").symlink_to(test_world.target)
    (root / "prompts.jsonl").write_text(json.dumps({"id": "a", "prompt": "def add(x, y):"}) + "\n")
    return root


@pytest.fixture(scope="session")
def trace_world(tmp_path_factory) -> Path:
    """The trace fuzz reader's input: one step of examples/own_trainer.py recorded (`rec`) on a 12-layer random
    target whose tensors differ by value (tests/test_trace.py's), as `dflash-audit trace` records it."""
    from dflash_audit.trace.record.launch import record_script
    from dflash_world.target_training import distinct_random_qwen3

    root = tmp_path_factory.mktemp("trace-world")
    distinct_random_qwen3(12, 64, 512).save_pretrained(root / "target")
    record_script(REPO / "examples" / "own_trainer.py", ["--target", str(root / "target")], root / "rec")
    return root


def pytest_sessionfinish(session):
    from tests.bad_inputs import test_fuzz

    test_fuzz.save_findings()

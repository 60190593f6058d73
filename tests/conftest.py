"""The fixtures every module of the harness's own tests shares (pytest finds them here: no test
module imports another's fixtures)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from dflash_world import cached_test_world
from dflash_world.suite_placement import world_in_suite_dtype
from dflash_world.target_training import random_qwen3
from dflash_world.tokenizer import train_tokenizer
from impl.model import DFlashDrafter
from tests.helpers import TEXTS, load_trained_pair, once_per_session, tiny_spec, tiny_target

# `make quick`: a cross-section of the harness's own tests that needs no trained world (seconds each):
# specs and layers, masks, layering and the catalogue, every format loader, the static audit, the team checkpoint
# of the README's opening story.
QUICK_MODULES = {"test_spec", "test_layers", "test_masks_anchors", "test_layering", "test_pitfalls", "test_formats",
                 "test_compare_static", "test_team_checkpoint", "test_model_checkpoint", "test_extract"}


def pytest_configure(config):
    config.addinivalue_line("markers", "unforeseen: the test provokes an unforeseen fault on purpose "
                                       "(tests/refusal_scan.py lets its 'rerun with --debug' line pass)")


@pytest.fixture(scope="session", autouse=True)
def unforeseen_log(tmp_path_factory):
    """The file every unforeseen fault of this session appends to, in-process or in a subprocess the suite
    starts (a demo, a CLI run): `dflash_audit/faults.py` reads its name from the environment."""
    from dflash_audit.faults import UNFORESEEN_LOG

    log = tmp_path_factory.mktemp("unforeseen") / "faults.log"
    log.touch()
    before = os.environ.get(UNFORESEEN_LOG)
    os.environ[UNFORESEEN_LOG] = str(log)
    yield log
    if before is None:
        os.environ.pop(UNFORESEEN_LOG, None)
    else:
        os.environ[UNFORESEEN_LOG] = before


@pytest.fixture(scope="session", autouse=True)
def session_temp_dir(tmp_path_factory):
    """One fresh temp folder for this session's process (each xdist worker its own): TMPDIR and `tempfile.tempdir`
    point at it, so the tool in-process and every subprocess a test starts (a CLI, torchrun, an engine) take their
    temporary files there. At the session's end it must be empty: whatever ends a run, the tool removes what it
    made. (pytest's own tmp_path folders are fixed before, outside it.)"""
    import shutil
    import tempfile

    tmp_path_factory.getbasetemp()  # pinned first: pytest's folders stay where they are, outside the check
    folder = Path(tempfile.mkdtemp(prefix="dflash-tests-tmp-"))
    before = os.environ.get("TMPDIR"), tempfile.tempdir
    os.environ["TMPDIR"] = tempfile.tempdir = str(folder)
    yield folder
    if before[0] is None:
        os.environ.pop("TMPDIR", None)
    else:
        os.environ["TMPDIR"] = before[0]
    tempfile.tempdir = before[1]
    # torch's compile cache is torch's, not a leftover: parts of torch put it in the temp dir by name whatever
    # TORCHINDUCTOR_CACHE_DIR says (torch/_inductor/cache.py, `default_cache_dir`).
    left = sorted(path.name for path in folder.iterdir() if not path.name.startswith("torchinductor_"))
    shutil.rmtree(folder, ignore_errors=True)
    assert not left, f"left behind in the session's temp dir (TMPDIR) by the tool or a process it ran: {left}"


@pytest.fixture(autouse=True)
def refusal_scan(request, unforeseen_log):
    """Every refusal the CLI gives in this test, checked by tests/refusal_scan.py after it; and no unforeseen
    fault in any process the test ran (the session's log grows by none)."""
    from tests.refusal_scan import offences, recorded_refusals

    start = unforeseen_log.stat().st_size
    with recorded_refusals() as seen:
        yield
    if request.node.get_closest_marker("unforeseen") is None:
        found = offences(seen)
        with unforeseen_log.open(encoding="utf-8") as log:
            log.seek(start)
            found += [f"an unforeseen fault in a process the test ran: {line}" for line in log.read().splitlines()
                      if not line.startswith(f"{os.getpid()}: ")]  # (this process's: the scan above has them)
        assert not found, "refusals that are defects:\n" + "\n".join(found)


# The session's longest modules (the live engine runs, vLLM's some minutes; the corpus of every finding; the reference
# pipeline; torchrun's; then the traced processes, the reference subprocesses, the installs, the bfloat16 pass's
# longest), longest first. xdist's work-stealing hands each worker a contiguous share of the collection and a worker
# out of work steals from the end of another's queue: so each share is ordered long modules first, then short tests.
# Every worker starts on long ones at once, and what ends a share, or is stolen, is short tests, never a 20 s test
# begun last with nothing left to overlap it. Each module stays whole (its module-scoped fixtures are built once). The
# order depends only on the collection and the worker count: every worker collects the same, whatever the machine.
LONG_MODULES = ("test_every_finding", "test_reference_pipeline", "test_modelopt_golden", "test_live_long",
                "test_torchrun_cli", "test_vllm_hidden_states", "test_live_check", "test_live_llamacpp",
                "test_offline", "test_trace_run", "test_trace_evaluators", "test_class13_traced_process",
                "test_class12_crashing_trainers", "test_trace", "test_family_drafters", "test_trace_field",
                "test_specforge_golden", "test_install", "test_plug_versions", "test_demo", "test_trace_corpus",
                "test_class6_valid_layouts", "test_ddtree", "test_gguf", "test_kept_answers")


def long_modules_first_in_each_share(items: list, workers: int) -> list:
    """`items` reordered: the long modules dealt in turn (longest first) to `workers` shares, each share its long
    modules and then short tests up to the size xdist's work-stealing gives it (what is left over after each earlier
    share, split evenly among the rest)."""
    def module(item) -> str:
        return item.module.__name__.rsplit(".", 1)[-1]

    by_module: dict[str, list] = {}
    for item in items:
        if module(item) in LONG_MODULES:
            by_module.setdefault(module(item), []).append(item)
    short = [item for item in items if module(item) not in LONG_MODULES]
    long_groups = [by_module[name] for name in LONG_MODULES if name in by_module]
    ordered: list = []
    for share in range(workers):
        long_items = [item for group in long_groups[share::workers] for item in group]
        size = (len(items) - len(ordered)) // (workers - share)
        room = max(0, size - len(long_items))
        ordered += long_items + short[:room]
        short = short[room:]
    return ordered + short


def pytest_itemcollected(item):
    if item.module.__name__.rsplit(".", 1)[-1] in QUICK_MODULES:  # as collected: `-m quick` selects by it
        item.add_marker(pytest.mark.quick)


@pytest.hookimpl(trylast=True)  # after `-m` has deselected: the shares are of what runs
def pytest_collection_modifyitems(config, items):
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))  # set in each xdist worker
    items[:] = long_modules_first_in_each_share(items, max(workers, 1))


@pytest.fixture(scope="session")
def test_world():
    """Tokenizer + trained TEST_TARGET + held-out prompts, built once and cached; its target in the
    suite's dtype (`DFLASH_AUDIT_DTYPE`, dflash_world/suite_placement.py)."""
    return world_in_suite_dtype(cached_test_world())


@pytest.fixture(scope="session")
def llamacpp_full_gguf(test_world, tmp_path_factory):
    """The all-full test drafter (target layers 1, 2, 3) written by `convert --for llamacpp` (ours -> z-lab ->
    llama.cpp's converter, f32): converted once a session (whichever worker first needs it), for the static and the
    live llama.cpp tests alike."""
    from dflash_audit.cli import main
    from dflash_world.drafter import cached_full_drafter

    def convert() -> str:
        out = tmp_path_factory.mktemp("llamacpp-full")
        assert main(["convert", "--from", str(cached_full_drafter(test_world)), "--to", str(out / "full"),
                     "--for", "llamacpp", "--target", str(test_world.target)]) == 0
        return str(out / "full" / "drafter-f32.gguf")

    return Path(once_per_session(tmp_path_factory, "llamacpp-full-gguf", convert))


@pytest.fixture(scope="module")
def trained_pair(test_world):
    """(drafter, target, prompts, stop ids): the test world's target and its cached trained drafter."""
    return load_trained_pair(test_world)


@pytest.fixture(scope="module")
def dflash2_pair(test_world):
    """The same, with the world's cached trained DFlash2 drafter."""
    return load_trained_pair(test_world, family="dflash2")


@pytest.fixture(scope="module")
def spec():
    return tiny_spec()  # 2 sliding + 1 full layer, ids (1, 3, 4) of a 6-layer target


@pytest.fixture(scope="module")
def drafter(spec):
    torch.manual_seed(0)
    return DFlashDrafter(spec)


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("target")
    tiny_target().save_pretrained(path)
    return path.resolve()


@pytest.fixture(scope="module")
def tiny_world(tmp_path_factory):
    """A random tiny Qwen3 target with a real BPE tokenizer (has <|mask|>), saved as an HF dir."""
    root = tmp_path_factory.mktemp("tiny-world")
    tokenizer = train_tokenizer(TEXTS, vocab_size=300)
    random_qwen3(4, 64, len(tokenizer)).save_pretrained(root / "target")
    tokenizer.save_pretrained(root / "target")
    data = root / "data.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    return root

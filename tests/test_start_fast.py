"""Each verb imports only what it runs (a subprocess per case, its `sys.modules` read at exit).

- `--help` and `--version` import no verb module and no torch: they answer in a fraction of a second.
- A static `compare` (no `--target`, or `--static-only`) imports neither the decoding loops, the dynamic audit nor
  our drafter's model, and no transformers modelling code: it reads tensors and settings, nothing more.

The module sets are pinned, not the times: a test never depends on the machine's speed. The times are bench figures
(`bench/bench_static_scale.py`: the 27B-shape static compare against its read floor).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from drafter_files.checkpoint import save_checkpoint
from impl.model import DFlashDrafter
from drafter_files.zlab_format import save_zlab_dir
from tests.helpers import tiny_spec

REPO = Path(__file__).resolve().parents[1]
PROBE = """
import sys
from dflash_audit.cli import main
status = main(sys.argv[1:])
print("--modules--")
print("\\n".join(sorted(sys.modules)))
sys.exit(status)
"""
# Never imported by a static compare: the live and offline loops, the τ half of compare, our model.
DYNAMIC_ONLY = ("impl.model", "impl.decoding", "impl.ddtree", "impl.offline", "impl.train", "impl.memory_plan",
                "dflash_audit.audit.dynamic", "dflash_world.target_training")
MODELLING = re.compile(r"^transformers\.models\.[\w.]+\.modeling_\w+$|^transformers\.(modeling_utils|activations)$")


def imported(*argv: str) -> tuple[int, set[str], str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    result = subprocess.run([sys.executable, "-c", PROBE, *argv], capture_output=True, text=True, env=env, cwd=REPO,
                            timeout=300)
    _, _, modules = result.stdout.partition("--modules--\n")
    return result.returncode, set(modules.split()), result.stderr


@pytest.mark.parametrize("argv", [["--help"], ["--version"]])
def test_help_and_version_import_no_verb_and_no_torch(argv):
    status, modules, err = imported(*argv)
    assert status == 0, err
    assert "torch" not in modules and "transformers" not in modules
    assert not {m for m in modules if m.startswith("dflash_audit.commands.")}, "a verb was imported"


@pytest.fixture(scope="module")
def static_pair(tmp_path_factory):
    """ours.pt (its fc over 2 of 3 layers) against a z-lab folder: a static compare with a finding to report."""
    root = tmp_path_factory.mktemp("start-fast")
    torch.manual_seed(0)
    save_checkpoint(root / "ours.pt", DFlashDrafter(tiny_spec(target_layer_ids=(1, 3))))
    ref = DFlashDrafter(tiny_spec())
    save_zlab_dir(root / "ref", ref.spec, ref.state_dict())
    return root


@pytest.mark.parametrize("extra", [[], ["--static-only"]])
def test_a_static_compare_imports_no_decoding_and_no_modelling(static_pair, tmp_path, extra):
    status, modules, err = imported("compare", "--ours", str(static_pair / "ours.pt"), "--ref",
                                    str(static_pair / "ref"), "--out", str(tmp_path / "report"), *extra)
    assert status == 1, err  # the fc finding: the audit really ran
    assert (tmp_path / "report" / "report.json").is_file()
    loaded = {m for m in modules if any(m == d or m.startswith(d + ".") for d in DYNAMIC_ONLY)}
    assert not loaded, f"a static compare imported {sorted(loaded)}"
    assert not {m for m in modules if MODELLING.match(m)}, "a static compare imported transformers' modelling"
    assert "dflash_audit.commands.compare" in modules and "dflash_audit.commands.train" not in modules


@pytest.mark.parametrize("table", [[], ["--table"]])
def test_eval_refuses_a_bad_prompts_file_before_importing_the_decoding_loops(tmp_path, table):
    """A bad input is one line in the seconds torch takes to import, not after the modelling code has loaded."""
    prompts = tmp_path / "gsm8k.jsonl"
    prompts.write_text('{"problem": "not a gsm8k row"}\n' if table else "not json\n")
    status, modules, err = imported("eval", "--drafter", str(tmp_path / "d.pt"), "--target", str(tmp_path),
                                    "--prompts", f"gsm8k:{prompts}" if table else str(prompts), *table)
    assert status == 2 and len(err.strip().splitlines()) == 1, err
    loaded = {m for m in modules if any(m == d or m.startswith(d + ".") for d in DYNAMIC_ONLY)}
    assert not loaded, f"eval's refusal imported {sorted(loaded)}"
    assert not {m for m in modules if MODELLING.match(m)}, "eval's refusal imported transformers' modelling"

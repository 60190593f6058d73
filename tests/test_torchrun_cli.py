"""The CLI under the real `torchrun` launcher: two gloo ranks, `-m dflash_audit.cli`.

The launcher itself starts the CLI (rendezvous, process-group init, rank-0-only output and files, clean exit), and
the ranks' training is held to one process's (the trainer's DDP arithmetic). `--standalone` lets the launcher pick a
free rendezvous port, so two of these tests can run at once; `--log-dir` keeps its per-rank log folders in the
test's own folder (by default torchrun leaves a `torchelastic_*` folder in the temp dir on every run).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dflash_audit.cli import main
from dflash_audit.prompts import load_prompts
from dflash_world.drafter import cached_test_drafter
from drafter_files.checkpoint import load_checkpoint
from impl.model import DFlashDrafter
from tests.test_train import TINY_RUN

REPO = Path(__file__).resolve().parents[1]
TORCHRUN = Path(sys.executable).with_name("torchrun")
TIMEOUT_S = 240  # each run takes seconds; a hang (e.g. a rank stuck in a collective) fails the test instead

pytestmark = pytest.mark.slow

# Every rank runs the single-process computation on half the rows; what differs is only the
# order in which gloo sums the two halves' gradients before dividing by 2. That moves fp32
# gradients by a few ulps (~1e-7 relative); Adam divides by sqrt(v) and so passes such
# differences through at most ~lr * relative error per step: 1e-6 over 3 steps is generous
# for that and still far below one real update (lr = 3e-3).
ATOL, RTOL = 1e-6, 1e-5
DDP_RUN = dict(TINY_RUN, steps=3, batch_size=4, grad_accum=2, noise_std=0.05)  # batch 4 splits 2 + 2 over the ranks
TRAIN_FLAGS = [part for key, value in DDP_RUN.items() if key != "progress"
               for part in (f"--{key.replace('_', '-')}",
                            ",".join(map(str, value)) if isinstance(value, list) else str(value))]


def _workers(pid: int) -> list[int]:
    try:
        return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def torchrun(args: list, logs: Path, nproc: int = 2) -> subprocess.CompletedProcess:
    """`torchrun --standalone --nproc_per_node=N --log-dir LOGS -m dflash_audit.cli ARGS`, killed (workers too) on
    a hang."""
    launcher = [str(TORCHRUN)] if TORCHRUN.is_file() else [sys.executable, "-m", "torch.distributed.run"]
    command = [*launcher, "--standalone", f"--nproc_per_node={nproc}", "--log-dir", str(logs), "-m",
               "dflash_audit.cli", *map(str, args)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONIOENCODING="utf-8")
    proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, encoding="utf-8")
    try:
        out, err = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        workers = _workers(proc.pid)  # torchrun starts each worker in its own session
        proc.terminate()  # torchrun passes SIGTERM on to its workers
        try:
            out, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        for pid in workers:
            try:
                if "dflash_audit.cli" in Path(f"/proc/{pid}/cmdline").read_text() and os.getpgid(pid) == pid:
                    os.killpg(pid, signal.SIGKILL)
            except (OSError, ProcessLookupError):
                pass
        pytest.fail(f"torchrun did not finish within {TIMEOUT_S} s: {' '.join(command)}\n{err[-3000:]}")
    return subprocess.CompletedProcess(command, proc.returncode, out, err)


def test_entry_point_runs_as_a_module():
    # torchrun -m needs `python -m dflash_audit.cli` to run the CLI (without the __main__ guard it silently exits 0).
    done = subprocess.run([sys.executable, "-m", "dflash_audit.cli", "train"], cwd=REPO, capture_output=True,
                          text=True, timeout=120, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert done.returncode == 2 and "dflash-audit: error" in done.stderr


def test_train_under_torchrun_matches_one_process(tiny_world, tmp_path):  # noqa: F811
    common = ["train", "--target", tiny_world / "target", "--data", tiny_world / "data.jsonl", *TRAIN_FLAGS]
    single_dir, ddp_dir = tmp_path / "single", tmp_path / "ddp"
    single_dir.mkdir()
    ddp_dir.mkdir()
    assert main([str(a) for a in [*common, "--out", single_dir / "ckpt.pt"]]) == 0

    done = torchrun([*common, "--out", ddp_dir / "ckpt.pt", "--json", tmp_path / "ddp-stats.json"], tmp_path / "logs")
    assert done.returncode == 0, done.stderr[-3000:]
    # Only rank 0 reports and writes: one summary line, one checkpoint, no stray temp files.
    assert done.stdout.count("trained 3 steps") == 1, done.stdout
    assert sorted(p.name for p in ddp_dir.iterdir()) == ["ckpt.pt"]
    stats = json.loads((tmp_path / "ddp-stats.json").read_text())
    assert (stats["world_size"], stats["rank"], stats["steps"]) == (2, 0, 3)

    one, two = load_checkpoint(single_dir / "ckpt.pt"), load_checkpoint(ddp_dir / "ckpt.pt")
    assert two.step == one.step == DDP_RUN["steps"]
    assert two.spec == one.spec
    assert two.recipe == one.recipe  # same data hash, knobs and schedule
    assert (two.recipe.extra["batch_size"], two.recipe.extra["grad_accum"]) == (4, 2)
    assert two.recipe.noise_std == DDP_RUN["noise_std"] and two.recipe.max_anchors == DDP_RUN["max_anchors"]
    # The logged losses are means over ranks: the same curve; the weights within the DDP bound above.
    torch.testing.assert_close(torch.tensor(two.training_state["history"]), torch.tensor(one.training_state["history"]),
                               rtol=1e-5, atol=1e-7)
    assert one.state_dict.keys() == two.state_dict.keys()
    for key, value in one.state_dict.items():
        torch.testing.assert_close(two.state_dict[key], value, atol=ATOL, rtol=RTOL, msg=key)
    torch.manual_seed(0)  # the CLI's default --seed: the weights really moved, agreement is not trivial
    initial = DFlashDrafter(one.spec).state_dict()
    assert max((one.state_dict[k] - initial[k]).abs().max().item() for k in initial) > 100 * ATOL


def test_train_error_under_torchrun_exits_without_hanging(tiny_world, tmp_path):  # noqa: F811
    out = tmp_path / "ckpt.pt"
    done = torchrun(["train", "--target", tiny_world / "target", "--data", tiny_world / "data.jsonl", "--out", out,
                     *TRAIN_FLAGS, "--batch-size", "3"],  # the later flag wins: 3 rows do not split over 2 ranks
                    tmp_path / "logs")
    assert done.returncode != 0
    for rank in (0, 1):  # each rank says which it is
        assert f"dflash-audit: error: [rank {rank}/2] batch size 3 does not split across 2 ranks" in done.stderr
    assert not out.exists()


# Held faster in `make test` by test_offline_eval_under_torchrun_shares_one_cache_with_a_single_process (the eval verb
# under torchrun: its JSON, every prompt's rounds and τ, equal to one process's) and
# test_compare_under_torchrun_shards_the_prompts_and_writes_the_same_report (five prompts over the ranks, three and
# two, their order restored, rank 0 alone reporting). Only the live loop's mode under the launcher is this case's alone.
@pytest.mark.full
def test_eval_under_torchrun_shards_and_gathers(test_world, tmp_path):
    # Five prompts: the ranks get three and two, interleaved, so the gather has to restore the order.
    prompts = tmp_path / "five.jsonl"
    prompts.write_text("\n".join(Path(test_world.prompts).read_text().splitlines()[:5]) + "\n")
    ids = [p["id"] for p in load_prompts(prompts)]
    assert len(ids) == len(set(ids)) == 5
    common = ["eval", "--drafter", cached_test_drafter(test_world), "--target", test_world.target,
              "--prompts", prompts, "--mode", "live", "--max-new-tokens", 24]
    single, sharded_dir = tmp_path / "single.json", tmp_path / "sharded"
    sharded_dir.mkdir()
    assert main([str(a) for a in [*common, "--json", single]]) == 0

    done = torchrun([*common, "--json", sharded_dir / "out.json"], tmp_path / "logs")
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("mean τ") == 1, done.stdout  # rank 0 prints the table once
    assert sorted(p.name for p in sharded_dir.iterdir()) == ["out.json"]
    one, two = json.loads(single.read_text()), json.loads((sharded_dir / "out.json").read_text())
    assert [p["id"] for p in two["prompts"]] == ids  # every prompt exactly once, in file order
    for a, b in zip(one["prompts"], two["prompts"]):
        assert (b["id"], b["rounds"]) == (a["id"], a["rounds"])
        assert b["tau"] == a["tau"]
    assert two == one
    # A trained drafter: acceptance is not trivially zero, so equal rounds mean something.
    assert max(p["tau"] for p in two["prompts"]) > 1.5


def test_offline_eval_under_torchrun_shares_one_cache_with_a_single_process(test_world, tmp_path):
    cache = tmp_path / "cache"
    common = ["eval", "--drafter", cached_test_drafter(test_world), "--target", test_world.target,
              "--prompts", test_world.prompts, "--mode", "offline", "--max-new-tokens", 24, "--cache-dir", cache]
    single, sharded = tmp_path / "single.json", tmp_path / "sharded.json"
    assert main([str(a) for a in [*common, "--json", single]]) == 0
    files = sorted(cache.glob("offline/*.safetensors"))  # <cache root>/offline/<key>.safetensors
    assert len(files) == 1
    stamp = files[0].stat().st_mtime_ns

    done = torchrun([*common, "--json", sharded], tmp_path / "logs")
    assert done.returncode == 0, done.stderr[-3000:]
    assert sorted(cache.glob("offline/*.safetensors")) == files and files[0].stat().st_mtime_ns == stamp  # read
    assert json.loads(sharded.read_text()) == json.loads(single.read_text())
    # That a sharded run builds the one full cache a single process then reuses (the runner eval and compare share,
    # `replay_offline`): the compare case below, its sharded run first.


def test_compare_under_torchrun_shards_the_prompts_and_writes_the_same_report(test_world, tmp_path):
    # Five prompts over two ranks (three and two); one cache, built by rank 0, whole: a single process then reuses it
    # as it is; the τ of every prompt as one process.
    from dflash_world.drafter import cached_test_drafter as drafter_of

    prompts = tmp_path / "five.jsonl"
    prompts.write_text("\n".join(Path(test_world.prompts).read_text().splitlines()[:5]) + "\n")
    common = ["compare", "--ours", drafter_of(test_world), "--ref", drafter_of(test_world, "ce"),
              "--target", test_world.target, "--prompts", prompts, "--max-new-tokens", 16, "--budget", 4,
              "--cache-dir", tmp_path / "cache"]
    done = torchrun([*common, "--out", tmp_path / "sharded"], tmp_path / "logs")
    assert done.stdout.count("report: ") + done.stderr.count("report: ") == 1  # rank 0 alone reports
    files = list((tmp_path / "cache" / "offline").glob("*.safetensors"))
    assert len(files) == 1  # one shared cache
    stamp = files[0].stat().st_mtime_ns
    single = main([str(a) for a in [*common, "--out", tmp_path / "single"]])
    assert done.returncode == single, done.stderr[-3000:]
    assert list((tmp_path / "cache" / "offline").glob("*.safetensors")) == files  # reused whole, not extended
    assert files[0].stat().st_mtime_ns == stamp
    one = json.loads((tmp_path / "single" / "report.json").read_text())
    two = json.loads((tmp_path / "sharded" / "report.json").read_text())
    assert [p["id"] for p in two["tau"]["prompts"]] == [p["id"] for p in one["tau"]["prompts"]]
    assert two["tau"] == one["tau"] and two["findings"] == one["findings"]

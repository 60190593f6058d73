"""Chunked tensor statistics (the static audit at scale) agree with whole-tensor float64 arithmetic."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dflash_audit.audit.stream_stats import clamp_cosine, is_finite, pair_stats, stats_all

ROOT = Path(__file__).resolve().parent.parent


def whole(a, b):
    a, b = a.double().flatten(), b.double().flatten()
    return float((a - b).abs().max()), float(a @ b) / float(a.norm() * b.norm())


@pytest.mark.parametrize("chunk", [7, 64, 1 << 22])
def test_chunked_stats_match_whole_tensor_float64(chunk):
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(33, 31, generator=gen).to(torch.bfloat16)
    b = (a.float() + 0.01 * torch.randn(33, 31, generator=gen)).to(torch.bfloat16)
    stats = pair_stats(a, b, chunk=chunk)
    diff, cosine = whole(a, b)
    assert stats.max_abs_diff == diff  # a max is exact whatever the chunking
    assert stats.cosine == pytest.approx(cosine, rel=1e-12)
    assert stats.finite_a and stats.finite_b


def test_identical_tensors_have_cosine_exactly_one_and_never_above():
    gen = torch.Generator().manual_seed(1)
    for _ in range(20):
        a = torch.randn(1000, generator=gen).to(torch.bfloat16)
        assert pair_stats(a, a.clone()) == pair_stats(a, a.clone(), chunk=13)
        assert pair_stats(a, a.clone()).cosine == 1.0
        # not bitwise equal (another dtype): the float64 path, clamped
        assert -1.0 <= pair_stats(a, a.float()).cosine <= 1.0
    assert clamp_cosine(1.0000000000016, 1.0, 1.0, identical=False) == 1.0
    assert clamp_cosine(-3.0, 1.0, 1.0, identical=False) == -1.0
    assert pair_stats(torch.zeros(5), torch.zeros(5)).cosine == 1.0
    assert pair_stats(torch.zeros(5), torch.ones(5)).cosine == 0.0


def test_nan_and_inf_are_found_on_the_side_that_holds_them():
    a = torch.ones(100, dtype=torch.bfloat16)
    nan, inf, neg = a.clone(), a.clone(), a.clone()
    nan[57], inf[3], neg[99] = float("nan"), float("inf"), float("-inf")
    assert is_finite(a) and not is_finite(nan) and not is_finite(inf) and not is_finite(neg)
    assert is_finite(torch.arange(4))  # integer tensors hold no NaN
    stats = pair_stats(a, nan, chunk=10)
    assert (stats.finite_a, stats.finite_b) == (True, False) and math.isnan(stats.max_abs_diff)
    same_inf = pair_stats(inf, inf.clone())  # bitwise equal but not finite: never called identical
    assert not same_inf.finite_a and not same_inf.finite_b


def test_many_pairs_at_once_equal_one_by_one():
    gen = torch.Generator().manual_seed(2)
    pairs = {f"t{i}": (torch.randn(50, generator=gen), torch.randn(50, generator=gen)) for i in range(5)}
    assert stats_all(pairs, {}, workers=2)[0] == {k: pair_stats(*ab) for k, ab in pairs.items()}


# Faster cases in `make test` hold its findings: tests/test_compare_static.py::test_fc_fed_fewer_layers_is_one_fc_dims_finding
# and test_convert.py::test_a_target_folder_without_weights_is_refused_for_speculators (the refusal's message).
@pytest.mark.full
def test_static_scale_bench_at_tiny_shape(tmp_path):
    """bench_static_scale end to end on the tiny shape: findings exact (none / fc_dims), memory rows recorded."""
    results = tmp_path / "results.json"
    # A clean environment, but for where bytecode is cached and temp files go (`make test`'s, this session's): its
    # eight processes then compile nothing again and write nothing beside the venv's sources.
    kept = {name: os.environ[name] for name in ("PYTHONPYCACHEPREFIX", "TMPDIR") if name in os.environ}
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_static_scale.py"), "--shape", "tiny",
                          "--tmp", str(tmp_path), "--results", str(results),
                          "--repeats", "1"], capture_output=True, text=True,
                         env={"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", **kept})
    assert out.returncode == 0, out.stderr[-2000:]
    entry = json.loads(results.read_text())["static_scale[tiny]"]
    assert entry["findings_ok"] and entry["speculators_refusal"]["exit"] == 2
    assert "no model.safetensors.index.json and no model.safetensors" in entry["speculators_refusal"]["message"]
    names = [row["name"] for row in entry["rows"]]
    assert any("identical pair: ours / floor wall" in n for n in names)
    assert sum("peak RssAnon" in n for n in names) == 6
    assert list(tmp_path.iterdir()) == [results]  # the generated pair is removed

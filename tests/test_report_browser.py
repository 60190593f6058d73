"""The HTML report of a real comparison, rendered in headless Chromium: no script errors, findings and charts present."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from impl.recipe import Recipe
from tests.helpers import compare_on_world, world_drafter

CHROMIUM = "/usr/bin/chromium"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync"]


def chromium(*args: str, user_data_dir: Path) -> subprocess.CompletedProcess:
    return subprocess.run([CHROMIUM, *FLAGS, f"--user-data-dir={user_data_dir}", *args],
                          capture_output=True, text=True, timeout=120)


@pytest.mark.skipif(shutil.which(CHROMIUM) is None, reason="run `make browser` to install chromium")
def test_report_renders_in_chromium(test_world, tmp_path):
    ours, ref = world_drafter(test_world, (1,), 0), world_drafter(test_world, (1, 2), 1)
    out = tmp_path / "report"
    report = compare_on_world(test_world, tmp_path, ours, ref, out=out, max_new_tokens=16, budget=8,
                              recipe=Recipe(gamma=7.0))
    assert report.dynamic is not None and report.dynamic.methods["dflash"].measured
    url = (out / "index.html").resolve().as_uri()

    dom = chromium("--enable-logging=stderr", "--v=0", "--dump-dom", url, user_data_dir=tmp_path / "profile")
    assert dom.returncode == 0, dom.stderr[-2000:]
    assert 'data-script-errors="0"' in dom.stdout
    console_errors = [line for line in dom.stderr.splitlines() if "CONSOLE" in line and "ERROR" in line.upper()]
    assert not console_errors, console_errors
    assert 'data-component="fc_dims"' in dom.stdout and 'data-component="recipe"' in dom.stdout
    for chart in ("tau-chart", "histogram", "position-chart"):
        assert re.search(rf'class="chart {chart}"', dom.stdout), chart
    assert dom.stdout.count("<rect") >= 2 * len(report.dynamic.methods["dflash"].prompts)

    screenshot = tmp_path / "report.png"  # never into the checkout
    shot = chromium(f"--screenshot={screenshot}", "--window-size=1280,2000", url, user_data_dir=tmp_path / "profile")
    assert shot.returncode == 0 and screenshot.stat().st_size > 10_000


@pytest.mark.skipif(shutil.which(CHROMIUM) is None, reason="run `make browser` to install chromium")
def test_serving_section_renders_for_both_drafters(tmp_path, spec, drafter):
    """`compare --serve` (what the demo runs): the serving section of each drafter, each engine, in Chromium.
    Static only (no target): seconds."""
    from dflash_audit.audit.compare import run_compare
    from drafter_files.checkpoint import save_checkpoint
    from drafter_files.zlab_format import save_zlab_dir

    save_checkpoint(tmp_path / "ours.pt", drafter)
    save_zlab_dir(tmp_path / "ref", spec, drafter.state_dict())
    out = tmp_path / "report"
    run_compare(tmp_path / "ours.pt", tmp_path / "ref", out=out, serve=["vllm", "sglang"])
    dom = chromium("--dump-dom", (out / "index.html").resolve().as_uri(), user_data_dir=tmp_path / "profile")
    assert dom.returncode == 0, dom.stderr[-2000:]
    assert 'data-script-errors="0"' in dom.stdout
    drafters = re.findall(r'class="serving-drafter" data-drafter="(ours|ref): ', dom.stdout)
    assert drafters == ["ours", "ref"]
    assert dom.stdout.count('data-engine="vllm"') == dom.stdout.count('data-engine="sglang"') == 2
    assert "--speculative-algorithm DFLASH" in dom.stdout and "vllm serve" in dom.stdout

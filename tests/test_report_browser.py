"""The HTML report of a real comparison, rendered in headless Chromium: no script errors, findings and charts present."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoTokenizer

from dflash_audit.commands.compare import run_compare
from dflash_audit.world import mask_token_id
from impl.checkpoint import save_checkpoint, save_zlab_dir
from impl.model import DFlashDrafter
from impl.spec import DraftSpec, Recipe

CHROMIUM = "/usr/bin/chromium"
SCREENSHOT = Path(__file__).resolve().parents[1] / "reports" / "browser" / "report.png"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync"]


def world_drafter(world, layer_ids, seed) -> DFlashDrafter:
    """A drafter sized for the test world's target (untrained: τ is measured, not good)."""
    config = AutoConfig.from_pretrained(world.target)
    tokenizer = AutoTokenizer.from_pretrained(world.target)
    torch.manual_seed(seed)
    return DFlashDrafter(DraftSpec(
        hidden_size=config.hidden_size, intermediate_size=2 * config.hidden_size, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, num_hidden_layers=1, vocab_size=config.vocab_size,
        target_layer_ids=layer_ids, num_target_layers=config.num_hidden_layers,
        mask_token_id=mask_token_id(tokenizer), block_size=8))


def chromium(*args: str, user_data_dir: Path) -> subprocess.CompletedProcess:
    return subprocess.run([CHROMIUM, *FLAGS, f"--user-data-dir={user_data_dir}", *args],
                          capture_output=True, text=True, timeout=120)


@pytest.mark.skipif(shutil.which(CHROMIUM) is None, reason="run `make browser` to install chromium")
def test_report_renders_in_chromium(test_world, tmp_path):
    ours, ref = world_drafter(test_world, (1,), 0), world_drafter(test_world, (1, 2), 1)
    save_checkpoint(tmp_path / "ours.pt", ours, recipe=Recipe(gamma=7.0))
    save_zlab_dir(tmp_path / "ref", ref.spec, ref.state_dict())
    out = tmp_path / "report"
    report = run_compare(tmp_path / "ours.pt", tmp_path / "ref", target=test_world.target,
                         prompts=test_world.prompts, out=out, max_new_tokens=16, budget=8,
                         cache_dir=tmp_path / "offline")
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

    SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
    shot = chromium(f"--screenshot={SCREENSHOT}", "--window-size=1280,2000", url, user_data_dir=tmp_path / "profile")
    assert shot.returncode == 0 and SCREENSHOT.stat().st_size > 10_000

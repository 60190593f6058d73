"""The HTML reports in headless Chromium: a real comparison's (no script errors, findings and charts present) and the
trace page's data flow (every label drawn whole, none over another)."""

from __future__ import annotations

import html
import json
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
    for chart in ("tau-chart", "histogram", "position-chart", "along-chart"):
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
    from dflash_audit.flags.compare import CompareFlags
    from drafter_files.checkpoint import save_checkpoint
    from drafter_files.zlab_format import save_zlab_dir

    save_checkpoint(tmp_path / "ours.pt", drafter)
    save_zlab_dir(tmp_path / "ref", spec, drafter.state_dict())
    out = tmp_path / "report"
    run_compare(CompareFlags(ours=tmp_path / "ours.pt", ref=tmp_path / "ref", out=out, serve=["vllm", "sglang"]))
    dom = chromium("--dump-dom", (out / "index.html").resolve().as_uri(), user_data_dir=tmp_path / "profile")
    assert dom.returncode == 0, dom.stderr[-2000:]
    assert 'data-script-errors="0"' in dom.stdout
    drafters = re.findall(r'class="serving-drafter" data-drafter="(ours|ref): ', dom.stdout)
    assert drafters == ["ours", "ref"]
    assert dom.stdout.count('data-engine="vllm"') == dom.stdout.count('data-engine="sglang"') == 2
    assert "--speculative-algorithm DFLASH" in dom.stdout and "vllm serve" in dom.stdout


# Written into a copy of the trace page: the drawn extent of every label of the data flow (the glyphs' own box, so a
# label running past its column shows) and its text, into the DOM that --dump-dom prints.
LABEL_BOXES = """<script>
const labels = [...document.querySelectorAll('.flow text, .flow .node-label')].map(el => {
  const range = document.createRange(); range.selectNodeContents(el);
  const r = range.getBoundingClientRect();
  return {text: el.textContent, box: [r.left, r.top, r.right, r.bottom]};
});
const out = document.createElement('pre'); out.id = 'label-boxes'; out.textContent = JSON.stringify(labels);
document.body.appendChild(out);
</script>"""


def trace_report_with_flow(flow: dict):
    from dflash_audit.trace.step_audit.audit import TraceReport

    facts = {"target": {"path": "/targets/qwen3", "class": "Qwen3ForCausalLM", "placement": ["cpu"]},
             "drafter": {"class": "dflash.model:DFlashDraftModel", "placement": ["cpu"],
                         "facts": {"num_hidden_layers": 5}},
             "steps": 1, "recording": "/runs/trace"}
    return TraceReport([], [], facts, flow)


@pytest.mark.skipif(shutil.which(CHROMIUM) is None, reason="run `make browser` to install chromium")
@pytest.mark.parametrize("width", [1280, 560])
def test_trace_flow_labels_never_overlap(tmp_path, width):
    """The trace page's data flow, its labels as a traced step writes them (the loss's reduction, the targets'
    derivation) and far longer (a 48-layer fc list, one unbroken 160-character word): every label is drawn whole,
    and no two labels' drawn boxes intersect, at a wide and a narrow window."""
    from dflash_audit.trace.report import flow_nodes, write_report_html

    flows = {
        "as traced": {"fc_layers": [1, 3, 5, 7, 9], "reference_layers": [1, 3, 5, 7, 9], "target_layers": 12,
                      "divergent": ["loss"], "weights": "exp(-(k-1)/7) (fit to 1e-07)",
                      "loss_kind": "kl_div, sum(w * mask * loss) / (sum(mask) + 1e-5) per sequence, then the mean",
                      "targets": "head(final_norm(raw output of layer 11)) = the target's own logits",
                      "target_shift": 0},
        "long": {"fc_layers": list(range(48)), "reference_layers": list(range(1, 49)), "target_layers": 64,
                 "divergent": ["fc", "targets"], "weights": "w" * 160, "loss_kind": "kl_div " * 30,
                 "targets": "head(final_norm(" * 8 + "x" + ")" * 16, "target_shift": -62},
    }
    for name, flow in flows.items():
        report = trace_report_with_flow(flow)
        page = tmp_path / name / "index.html"
        page.parent.mkdir()
        write_report_html(report, page)
        probe = page.with_name("probe.html")
        probe.write_text(page.read_text().replace("</body>", LABEL_BOXES + "</body>"))
        dom = chromium(f"--window-size={width},1000", "--dump-dom", probe.resolve().as_uri(),
                       user_data_dir=tmp_path / "profile")
        assert dom.returncode == 0, dom.stderr[-2000:]
        found = re.search(r'<pre id="label-boxes">(.*?)</pre>', dom.stdout, re.S)
        assert found, dom.stdout[-2000:]
        labels = json.loads(html.unescape(found.group(1)))
        nodes = flow_nodes(report)
        for i, a in enumerate(labels):
            for b in labels[i + 1:]:
                (al, at, ar, ab), (bl, bt, br, bb) = a["box"], b["box"]
                overlap = min(ar, br) - max(al, bl) > 0.5 and min(ab, bb) - max(at, bt) > 0.5
                assert not overlap, (name, width, a, b)
        for label in labels:
            left, top, right, bottom = label["box"]
            assert right > left and bottom > top, label
        # Every label drawn whole: each box's name and its full detail, in order.
        assert [label["text"] for label in labels] == [t for n in nodes for t in (n["label"], n["detail"])]
        if width == 1280 and name == "as traced":  # looked at by eye when the layout changes; never in the checkout
            shot = chromium(f"--screenshot={tmp_path / 'trace.png'}", "--window-size=1280,700", page.resolve().as_uri(),
                            user_data_dir=tmp_path / "profile")
            assert shot.returncode == 0 and (tmp_path / "trace.png").stat().st_size > 10_000

"""`dflash-audit eval --table` on the test world: τ per prompt set × τ method × decoding × temperature, with the chat
template's thinking switch, recorded as JSON and rendered as HTML (in headless Chromium)."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from dflash_world.drafter import cached_test_drafter
from tests.helpers import cli_in_process

FIXTURES = Path(__file__).parent / "fixtures" / "benchmarks"
TEMPLATE = Path(__file__).parents[1] / "dflash_world" / "chat_template_thinking.jinja"
CHROMIUM = "/usr/bin/chromium"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync"]


def eval_cli(*args) -> subprocess.CompletedProcess:
    return cli_in_process("eval", *args)  # what it answers and writes, not a process: in this one


@pytest.fixture(scope="module")
def table(test_world, tmp_path_factory):
    """One table run: two sets, three τ methods, DFlash and DDTree (budget 8), T = 0 and T = 0.8 over two seeds."""
    out = tmp_path_factory.mktemp("table")
    run = eval_cli("--drafter", cached_test_drafter(test_world), "--target", test_world.target,
                   "--prompts", f"humaneval:{FIXTURES / 'humaneval.jsonl'}", "--prompts", f"mt-bench:{FIXTURES / 'mt_bench.jsonl'}",
                   "--tau-method", "live", "--tau-method", "teacher-forced", "--tau-method", "zlab-benchmark",
                   "--method", "dflash", "--method", "ddtree", "--budget", 8,
                   "--temperature", 0, "--temperature", 0.8, "--seeds", "0,1",
                   "--chat-template", TEMPLATE, "--chat-template-kwargs", '{"enable_thinking": false}',
                   "--max-new-tokens", 16, "--table", "--published", "Qwen3-8B",
                   "--json", out / "table.json", "--html", out / "table.html")
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads((out / "table.json").read_text()), out / "table.html", run.stdout


def test_table_cells_cover_sets_methods_decodings_and_temperatures(table):
    data, _, stdout = table
    assert data["schema"] == "dflash-audit/tau-table-1"
    assert {(s["name"], s["count"]) for s in data["sets"]} == {("humaneval", 3), ("mt-bench", 2)}
    assert all(s["rendering"] and s["selection"] for s in data["sets"])
    cells = {(c["set"], c["method"], c["decoding"], c["budget"], c["temperature"]) for c in data["cells"]}
    assert ("humaneval", "live", "ddtree", 8, 0.0) in cells and ("humaneval", "teacher-forced", "ddtree", 8, 0.0) in cells
    assert ("mt-bench", "zlab-benchmark", "dflash", None, 0.8) in cells
    assert not any(c[1] == "teacher-forced" and c[4] > 0 for c in cells)  # greedy by definition: not run, said
    assert not any(c[0] == "mt-bench" and c[1] == "teacher-forced" for c in cells)  # no reference answers
    assert any("teacher-forced" in note for note in data["skipped"])
    for cell in data["cells"]:
        assert cell["chat_template"]["kwargs"] == {"enable_thinking": False} and cell["chat_template"]["mode"] == "file"
        assert cell["tau"] >= 1.0 and cell["count"] == (4 if cell["set"] == "mt-bench" and
                                                        cell["method"] != "teacher-forced" else 3)
        if cell["temperature"] > 0:  # each seed's τ, their range, the seeds themselves
            assert cell["seeds"] == [0, 1] and len(cell["per_seed"]) == 2
            assert cell["seed_range"] == [min(cell["per_seed"]), max(cell["per_seed"])]
    assert "humaneval" in stdout and "τ" in stdout


def test_published_figures_sit_beside_matching_cells(table):
    data, _, stdout = table
    live = next(c for c in data["cells"] if (c["set"], c["method"], c["decoding"], c["temperature"]) ==
                ("humaneval", "live", "dflash", 0.0))
    assert {(f["tau"], f["source"]) for f in live["published"]} == {(6.61, "ddtree-table"),
                                                                    (6.50, "dflash-paper-via-vllm")}
    tree = next(c for c in data["cells"] if (c["set"], c["method"], c["decoding"], c["temperature"]) ==
                ("mt-bench", "live", "ddtree", 0.0))
    assert [f["tau"] for f in tree["published"]] == [6.58]
    sampled = next(c for c in data["cells"] if (c["set"], c["method"], c["decoding"], c["temperature"]) ==
                   ("mt-bench", "live", "dflash", 0.8))
    assert sampled["published"] == []  # the published sampled figures are at T = 1
    forced = next(c for c in data["cells"] if c["method"] == "teacher-forced")
    assert forced["published"] == []  # the Model-Optimizer fixed-ground-truth figure is GSM8K only
    assert "6.61 (ddtree-table" in stdout


@pytest.mark.skipif(shutil.which(CHROMIUM) is None, reason="run `make browser` to install chromium")
def test_table_html_renders_in_chromium(table, tmp_path):
    data, html_path, _ = table
    dom = subprocess.run([CHROMIUM, *FLAGS, f"--user-data-dir={tmp_path / 'profile'}", "--enable-logging=stderr",
                          "--v=0", "--dump-dom", html_path.resolve().as_uri()], capture_output=True, text=True,
                         timeout=120)
    assert dom.returncode == 0, dom.stderr[-2000:]
    console_errors = [line for line in dom.stderr.splitlines() if "CONSOLE" in line and "ERROR" in line.upper()]
    assert not console_errors, console_errors
    assert dom.stdout.count('class="chart"') == 2  # one chart per prompt set
    assert dom.stdout.count('class="bar"') == len(data["cells"])
    assert dom.stdout.count('class="published"') == sum(len(c["published"]) for c in data["cells"])
    assert "<h2 class=\"set\">humaneval</h2>" in dom.stdout and "enable_thinking" in dom.stdout


def test_thinking_on_and_off_record_different_tau_and_a_declared_setting_is_a_finding(test_world, tmp_path):
    """`--tau-by thinking` on a drafter declared trained with thinking off: both τ recorded, and they differ; the
    'thinking on' setting is a chat_template divergence."""
    out = tmp_path / "thinking.json"
    run = eval_cli("--drafter", cached_test_drafter(test_world), "--target", test_world.target,
                   "--prompts", f"humaneval:{FIXTURES / 'humaneval.jsonl'}", "--chat-template", TEMPLATE,
                   "--tau-by", "thinking", "--trained-chat-template-kwargs", '{"enable_thinking": false}',
                   "--max-new-tokens", 24, "--json", out)
    assert run.returncode == 0, run.stderr[-3000:]
    data = json.loads(out.read_text())
    taus = {c["chat"]: c["tau"] for c in data["cells"]}
    assert set(taus) == {"thinking on", "thinking off"} and taus["thinking on"] != taus["thinking off"]
    assert [f["chat"] for f in data["findings"]] == ["thinking on"]
    assert "enable_thinking: trained False, evaluated True" in data["findings"][0]["message"]
    assert "divergence  chat_template" in run.stdout


def test_bad_table_flags_exit_2_in_one_line(test_world, tmp_path):
    drafter = cached_test_drafter(test_world)
    humaneval = f"humaneval:{FIXTURES / 'humaneval.jsonl'}"
    for args, named in ((["--tau-method", "online"], "--tau-method"),
                        (["--tau-by", "thinking"], "--tau-by thinking needs a chat template"),
                        (["--chat-template-kwargs", "{bad"], "invalid JSON"),
                        (["--seeds", "a,b"], "--seeds"),
                        (["--tau-method", "zlab-benchmark"], "the target tokenizer has none"),
                        (["--published", "Llama-9B"], "--published")):
        run = eval_cli("--drafter", drafter, "--target", test_world.target, "--prompts", humaneval, "--table",
                       "--max-new-tokens", 8, *args)
        lines = run.stderr.strip().split("\n")
        assert run.returncode == 2 and len(lines) == 1 and named in lines[0], (args, run.stderr[-1500:])


def test_compare_records_the_chat_template(test_world, tmp_path):
    """compare --chat-template FILE --chat-template-kwargs: the τ audit's prompts rendered by it, and it is in the
    report."""
    drafter = cached_test_drafter(test_world)
    run = cli_in_process("compare", "--ours", drafter, "--ref", drafter, "--target", test_world.target,
                         "--prompts", test_world.prompts, "--max-new-tokens", 8, "--budget", 4,
                         "--out", tmp_path / "report", "--cache-dir", tmp_path / "cache", "--chat-template", TEMPLATE,
                         "--chat-template-kwargs", '{"enable_thinking": false}')
    assert run.returncode in (0, 1), run.stderr[-3000:]
    notes = json.loads((tmp_path / "report" / "report.json").read_text())["notes"]
    recorded = [json.loads(n.split(": ", 1)[1]) for n in notes if n.startswith("chat template: ")]
    assert recorded and recorded[0]["kwargs"] == {"enable_thinking": False} and recorded[0]["file"] == str(TEMPLATE)

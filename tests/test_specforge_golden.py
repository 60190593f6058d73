"""SpecForge 0.2.0's known divergences as a golden record.

Runs `pytest conformance --impl specforge --impl-only` (a subprocess, results in a temp dir; only what runs
SpecForge, failing examples not shrunk: CONFORMANCE_NO_SHRINK, conformance/README.md) and asserts that
the set of (component, PITFALLS entry) SpecForge fails equals the committed list
`held/specforge_known_divergences.toml`, each item with its explanation and SpecForge file:line.
CI stays green while SpecForge is what it is; any change in SpecForge, its wrapper or the suite
shows up here as an entry gained or lost.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
KNOWN = REPO / "held" / "specforge_known_divergences.toml"
SITE = Path(sys.modules["pytest"].__file__).resolve().parents[1]  # the venv's site-packages


def known_divergences() -> list[dict]:
    return tomllib.loads(KNOWN.read_text())["divergence"]


def test_every_known_divergence_says_why_and_where():
    for item in known_divergences():
        assert item["explanation"].strip() and "\n" not in item["explanation"], item
        for source in item["source"].split("; "):
            path, _, line = source.rpartition(":")
            lines = (SITE / path).read_text().splitlines()
            assert line.isdigit() and 1 <= int(line) <= len(lines), f"{source}: no such line in specforge"


@pytest.fixture(scope="module")
def specforge_results(tmp_path_factory):
    import held.specforge  # noqa: F401 -- `make setup` installs SpecForge: missing, this fails, never skips
    out = tmp_path_factory.mktemp("specforge-conformance")
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
           "CONFORMANCE_NO_SHRINK": "1"}  # read by conformance/strategies.py
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "conformance",
                          "--impl", "specforge", "--impl-only", "--report-dir", str(out)],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    summary = run.stdout.strip().splitlines()[-1] if run.stdout.strip() else run.stderr[-2000:]
    # Failures are expected (exit 1); errors (a crash outside a comparison) or a usage error are not.
    assert run.returncode in (0, 1) and not re.search(r"\d+ errors?\b", summary), summary
    return json.loads((out / "results.json").read_text())


def test_specforge_fails_exactly_its_known_divergences(specforge_results):
    failing = {(r["component"], r["pitfall"]) for r in specforge_results["components"] if r["status"] == "fail"}
    expected = {(item["component"], item["pitfall"]) for item in known_divergences()}
    assert failing == expected, (f"new failures: {sorted(failing - expected)}; "
                                 f"no longer failing: {sorted(expected - failing)}")


def test_specforge_plug_takes_every_call_of_the_interface(specforge_results):
    """held/specforge.py declares the current interface version: no plug mismatch (conformance/plug.py)."""
    assert specforge_results["interface"]["plug"] == specforge_results["interface"]["suite"]
    assert specforge_results["plug_mismatches"] == []


def test_specforge_unsupported_cases_are_na_with_a_reason(specforge_results):
    na = [r for r in specforge_results["components"] if r["status"] == "n/a"]
    assert na and all(r["reason"] for r in na)
    assert not any("Unsupported" in (r["diff"] or {}).get("message", "") for r in specforge_results["components"])

"""The versioned plug interface (impl/interface_versions.py, conformance/plug.py).

A plug written against an earlier interface (tests/plugs/specforge_interface_1.py: SpecForge 0.2.0 as a plug of
interface 1 holds it) gets a plug mismatch naming the interface change for every call it cannot take, and never
a divergence: run under today's suite, its failures are SpecForge's known divergences and nothing else.
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
import torch

from conformance.plug import Plug, PlugMismatch, current_parameters, declared_version, recipe_field, require
from impl import interface_versions as versions
from impl.interface import INTERFACE_VERSION

REPO = Path(__file__).resolve().parents[1]
OLD_PLUG = "tests.plugs.specforge_interface_1:SpecForgeInterface1"
# Conformance files that reach every kind of interface change an interface-1 plug misses: a recipe field
# (loss_fn, per_position_loss_weight, dpace_alpha), a keyword (training_outputs' anchors), operations added
# later (dpace_weights, dpace_loss; apply_rotary; DSpark's heads, which must be named before the test asks the
# plug to build a DSpark drafter), and calls it still takes (SpecForge's own divergences).
# The DFlash2 and reduced-vocabulary cases (conv, draft_vocab) are newer than the plug: each is a plug mismatch naming
# the version it needs, never SpecForge's `fail`.
SUBSET = ("conformance/test_loss.py", "conformance/test_dpace.py", "conformance/test_targets.py",
          "conformance/test_loss_weights.py", "conformance/test_rotary.py", "conformance/test_dspark_heads.py",
          "conformance/test_conv.py", "conformance/test_draft_vocab.py")


def old_plug():
    from tests.plugs.specforge_interface_1 import SpecForgeInterface1

    return SpecForgeInterface1()


def test_versions_cover_the_protocol_once():
    assert [v.number for v in versions.VERSIONS] == list(range(1, INTERFACE_VERSION + 1))
    ops = versions.operations()
    assert len(ops) == len(set(ops))
    for operation in ops:  # every operation is the protocol's, and every keyword a version added is in it
        parameters = current_parameters(operation)
        for version in versions.VERSIONS:
            assert set(version.keywords.get(operation, ())) <= set(parameters), (version.number, operation)
    from impl import interface
    from conformance.plug import PROTOCOLS
    declared = {name for protocol in PROTOCOLS for name, value in vars(protocol).items()
                if callable(value) and not name.startswith("_")}
    assert declared == set(ops), declared ^ set(ops)
    assert interface.INTERFACE_VERSION == versions.CURRENT
    for field in ("loss_fn", "per_position_loss_weight", "dpace_alpha", "gamma", "max_anchors"):
        assert versions.recipe_field_change(field) is not None, field


def test_an_interface_1_plug_is_told_each_change_it_missed():
    plug = Plug(old_plug())
    assert declared_version(plug.wrapped) == 1
    with pytest.raises(PlugMismatch, match=r"training_outputs\(\) takes no `anchors`: interface 4 added `anchors`"):
        plug.training_outputs(None, None, None, None, None, 4, 0, anchors=(torch.zeros(4), torch.ones(4)))
    with pytest.raises(PlugMismatch, match=r"generate\(\) takes no `temperature`: interface 3 added .*"
                                           r"generate\(\) takes no `seed`: interface 3 added"):
        plug.generate(None, None, None, 8, None, 0.8, 1)
    with pytest.raises(PlugMismatch, match=r"recipe \(SpecForgeRecipeV1\) has no `loss_fn`: interface 2 renamed "
                                           r"`loss_kind` to `loss_fn`.*declares no interface_version"):
        recipe_field(plug, "loss_fn")
    assert recipe_field(plug, "gamma") is None  # a field it has is its value
    with pytest.raises(PlugMismatch, match=r"no `dpace_loss` operation: interface 2 added"):
        plug.dpace_loss(None, None, None, 4, 0.5)
    with pytest.raises(PlugMismatch, match=r"no `apply_rotary` operation: interface 7 added"):
        plug.apply_rotary(None, None, None)
    with pytest.raises(PlugMismatch, match=r"no `markov_bias` operation: interface 9 added"):
        require(plug, "markov_bias")  # named before the test asks the plug for anything else
    # Positional calls it takes run as they are (SpecForge's own loss weights here).
    assert torch.equal(plug.loss_weights(4, None, False), Plug(plug.wrapped._today).loss_weights(4, None, False))


def test_an_interface_8_plug_is_told_what_interface_9_added():
    class Interface8:
        name = "interface-8"
        interface_version = 8

    plug = Plug(Interface8())
    for operation in ("markov_bias", "confidence_logits", "markov_path", "refiner_bias", "jacobi_tokens"):
        with pytest.raises(PlugMismatch, match=rf"no `{operation}` operation: interface 9 added .*implements interface 8"):
            require(plug, operation)
    require(Plug(type("Interface9", (Interface8,), {"interface_version": 9})()), "markov_bias")  # lacking it: n/a


def test_an_interface_9_plug_is_told_what_interface_10_added():
    class Interface9:
        name = "interface-9"
        interface_version = 9

    with pytest.raises(PlugMismatch, match=r"no `family_loss` operation: interface 10 added .*implements interface 9"):
        require(Plug(Interface9()), "family_loss")
    require(Plug(type("Interface10", (Interface9,), {"interface_version": 10})()), "family_loss")  # lacking it: n/a


def test_a_current_plug_lacking_an_operation_is_not_a_mismatch():
    from held.specforge import NOT_WRAPPED_DSPARK, SpecForgeImplementation
    from impl.interface import Unsupported, supports

    plug = Plug(SpecForgeImplementation())
    assert declared_version(plug.wrapped) == INTERFACE_VERSION
    assert not hasattr(plug, "apply_rotary")  # the optional operation it lacks: n/a, as the suite has it
    assert not supports(plug, "refiner_bias")  # SpecForge 0.2.0 has no XPress: declared unsupported (n/a)
    require(plug, "markov_bias")  # its DSpark, not wrapped: n/a saying so, never a mismatch
    with pytest.raises(Unsupported, match="not wrapped by this plug"):
        plug.markov_bias(None, None, None)
    assert "specforge/modeling/draft/dspark.py" in NOT_WRAPPED_DSPARK


@pytest.mark.parametrize("declared", [0, INTERFACE_VERSION + 1, "8", True])
def test_a_wrong_declaration_is_refused(declared):
    class Plugged:
        name = "x"
        interface_version = declared

    with pytest.raises(ValueError, match="interface_version"):
        declared_version(Plugged())


def test_a_wrong_declaration_is_one_line_exit_4():
    """pytest's usage error: one line naming the versions, no traceback."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "conformance/test_loss.py",
                          "--impl", "tests.plugs.wrong_version:Plugged"], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 4, run.stdout[-2000:] + run.stderr[-2000:]
    assert f"this suite knows versions 1 to {INTERFACE_VERSION}" in run.stderr
    assert "Traceback" not in run.stderr + run.stdout


def specforge_known() -> set[tuple[str, int]]:
    known = tomllib.loads((REPO / "held" / "specforge_known_divergences.toml").read_text())["divergence"]
    return {(item["component"], item["pitfall"]) for item in known}


@pytest.fixture(scope="module")
def old_plug_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("old-plug-conformance")
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *SUBSET,
                          "--impl", OLD_PLUG, "--report-dir", str(out)],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    summary = run.stdout.strip().splitlines()[-1] if run.stdout.strip() else run.stderr[-2000:]
    assert run.returncode == 1 and not re.search(r"\d+ errors?\b", summary), run.stdout[-3000:] + run.stderr[-2000:]
    return run.stdout, json.loads((out / "results.json").read_text())


def test_an_old_plug_gets_plug_mismatches_never_divergences(old_plug_results):
    stdout, results = old_plug_results
    rows = results["components"]
    mismatches = [r for r in rows if r["status"] == "plug-mismatch"]
    failing = {(r["component"], r["pitfall"]) for r in rows if r["status"] == "fail"}
    # What SpecForge really does differently still fails, each real divergence the plug can reach; nothing else does.
    reached = {(r["component"], r["pitfall"]) for r in rows if r["status"] in ("pass", "fail")}
    assert failing == specforge_known() & reached, sorted(failing ^ (specforge_known() & reached))
    newer = [r for r in rows if r["component"] in ("conv", "draft_vocab")
             and "specforge-interface-1" in r["implementations"]]
    assert newer and all(r["status"] in ("plug-mismatch", "n/a") for r in newer), newer
    for row in rows:
        message = (row["diff"] or {}).get("message", "")
        assert not re.search(r"TypeError|AttributeError|unexpected keyword|has no attribute", message), row
    messages = "\n".join(r["diff"]["message"] for r in mismatches)
    for change in ("training_outputs() takes no `anchors`: interface 4 added",
                   "has no `loss_fn`: interface 2 renamed `loss_kind` to `loss_fn`",
                   "has no `dpace_alpha`: interface 2 added", "no `dpace_weights` operation: interface 2 added",
                   "no `dpace_loss` operation: interface 2 added", "no `apply_rotary` operation: interface 7 added",
                   "no `confidence_logits` operation: interface 9 added",  # the heads test's last call
                   "no `markov_path` operation: interface 9 added",
                   "build_drafter() given a DFlash2 spec: interface 5 added DFlash2",
                   "build_drafter() given a spec with a reduced draft vocabulary: interface 7 added it"):
        assert change in messages, change
    assert results["interface"] == {"suite": INTERFACE_VERSION, "plug": 1}
    assert results["summary"]["plug-mismatch"] == len(mismatches)
    assert "plug mismatches (calls the plug cannot take; not divergences)" in stdout


def test_conformance_readme_lists_what_each_version_added():
    readme = (REPO / "conformance" / "README.md").read_text()
    rows = re.findall(r"^\| (\d+) \| (.+) \|$", readme, flags=re.M)
    assert [int(number) for number, _ in rows] == [v.number for v in versions.VERSIONS]
    for (_, text), version in zip(rows, versions.VERSIONS):
        for operation in version.operations:
            assert f"`{operation}" in text, (version.number, operation)
        for commit in filter(None, version.commit.split(", ")):
            assert commit in text, (version.number, commit)

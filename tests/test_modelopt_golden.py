"""NVIDIA Model-Optimizer 0.47.0's known divergences as a golden record (held/modelopt_known_divergences.toml).

`pytest conformance --impl modelopt --impl-only` (a subprocess, results in a temp dir; the live-decoding file is
left out: Model-Optimizer has no decoding loop, so it is n/a there) must fail exactly the recorded (component,
PITFALLS entry) pairs, with no plug failure: no plug mismatch, no error. Only what runs Model-Optimizer runs
(`--impl-only`: the references' own pairs and ours-only tests say nothing of it), and failing examples are not
shrunk (CONFORMANCE_NO_SHRINK: derandomized, the same examples are generated, so the same components fail; only
the minimal example in a diff entry is lost, which this test does not read). Each `[[claim]]` of the record (what its
changelog and code say it does differently) is checked here against its own code, at the recorded file:line.
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

REPO = Path(__file__).resolve().parents[1]
KNOWN = REPO / "held" / "modelopt_known_divergences.toml"
SITE = Path(sys.modules["pytest"].__file__).resolve().parents[1]  # the venv's site-packages (modelopt is there)


def record() -> dict:
    return tomllib.loads(KNOWN.read_text())


def source_line(source: str) -> str:
    path, _, line = source.rpartition(":")
    lines = (SITE / path).read_text().splitlines()
    assert line.isdigit() and 1 <= int(line) <= len(lines), f"{source}: no such line in nvidia-modelopt"
    return lines[int(line) - 1]


def test_every_entry_says_why_and_where():
    entries = record()["divergence"] + record()["claim"]
    for item in entries:
        assert item["explanation"].strip() and "\n" not in item["explanation"], item
        for source in item["source"].split("; "):
            source_line(source)


def test_each_claim_is_at_its_line():
    """The recorded line holds the code the claim is about (a moved line fails here, not silently)."""
    for claim in record()["claim"]:
        first = claim["source"].split("; ")[0]
        assert claim["code"] in source_line(first), (claim["name"], first, source_line(first))


@pytest.fixture(scope="module")
def plug():
    from held.modelopt import ModelOptImplementation

    return ModelOptImplementation()


def state_and_target(drafter_spec):
    from conformance.world import reference_state_dict, target_for

    return reference_state_dict(drafter_spec), target_for(drafter_spec)


def spec(**changes):
    from impl.spec import DraftSpec

    fields = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                  num_hidden_layers=2, target_vocab_size=96, target_layer_ids=(1, 3), num_target_layers=6,
                  mask_token_id=95, block_size=4)
    return DraftSpec(**{**fields, **changes})


def test_claim_dpace_is_its_default(plug):
    assert plug.recipe.per_position_loss_weight == "dpace"


def test_claim_distillation_from_the_target_logits(plug):
    assert plug.recipe.loss_fn == "kl_div"


def test_claim_one_target_layer_per_draft_layer(plug):
    """It refuses a drafter whose fc reads a number of target layers other than its layer count (both references
    take any): the plug answers such a spec n/a with that reason, so the rule does not fail every component."""
    from impl.interface import Unsupported

    assert "one target layer per draft layer is required" in source_line(
        "modelopt/torch/speculative/plugins/hf_dflash.py:461")
    weights, target = state_and_target(spec(target_layer_ids=(1,)))
    with pytest.raises(Unsupported, match="one target layer per draft layer"):
        plug.build_drafter(spec(target_layer_ids=(1,)), weights, target)


def test_claim_rope_theta_is_not_forced_under_transformers_5(plug):
    """Its rope enforcement reads `rope_theta` attributes that transformers 5 configs no longer have: the drafter
    keeps the theta it was given (not the target's), as the references do."""
    drafter_spec = spec(rope_theta=5000.0)
    weights, target = state_and_target(drafter_spec)
    assert target.config.rope_parameters["rope_theta"] != 5000.0
    x = torch.randn(1, 2, 3, 8, generator=torch.Generator().manual_seed(0))
    positions = torch.arange(40, 43)[None]
    rotated = plug.apply_rotary(plug.build_drafter(drafter_spec, weights, target), x, positions)
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding, apply_rotary_pos_emb
    cos, sin = Qwen3RotaryEmbedding(drafter_spec.qwen3_config())(x, positions)
    torch.testing.assert_close(rotated, apply_rotary_pos_emb(x, x, cos, sin)[1])


def test_claim_final_norm_reapplied_only_when_declared():
    """Offline: the captured final hidden is normed again only when its producer says it was captured before the
    norm (`base_hidden_prenorm`), which its vLLM capture path sets."""
    assert "base_hidden_prenorm" in source_line("modelopt/torch/speculative/plugins/modeling_final_norm.py:133")


def test_claim_seq_len_divisible_by_block(plug):
    """Its training forward refuses a row whose length is not a multiple of the block; the plug pads as its
    collator does (held/modelopt_ops.py), so this is its trainer's own rule, checked on the unpadded call."""
    assert "must be divisible by block_size" in source_line("modelopt/torch/speculative/plugins/hf_dflash.py:932")


@pytest.fixture(scope="module")
def modelopt_results(tmp_path_factory):
    import held.modelopt  # noqa: F401 -- `make setup` installs Model-Optimizer and its environment: never skips

    out = tmp_path_factory.mktemp("modelopt-conformance")
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
           "CONFORMANCE_NO_SHRINK": "1"}  # read by conformance/strategies.py
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "conformance",
                          "--ignore", "conformance/test_live_decoding.py", "--impl", "modelopt", "--impl-only",
                          "--report-dir", str(out)],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    summary = run.stdout.strip().splitlines()[-1] if run.stdout.strip() else run.stderr[-2000:]
    assert run.returncode in (0, 1) and not re.search(r"\d+ errors?\b", summary), summary
    return json.loads((out / "results.json").read_text())


def test_modelopt_fails_exactly_its_known_divergences(modelopt_results):
    failing = {(r["component"], r["pitfall"]) for r in modelopt_results["components"] if r["status"] == "fail"}
    expected = {(item["component"], item["pitfall"]) for item in record()["divergence"]}
    assert failing == expected, (f"new failures: {sorted(failing - expected)}; "
                                 f"no longer failing: {sorted(expected - failing)}")


def test_the_run_held_modelopt_only(modelopt_results):
    """`--impl-only` ran no pair of the references alone and no test of ours alone; DSpark's heads were compared
    (interface 9)."""
    rows = modelopt_results["components"]
    assert not [r["test"] for r in rows if r["test"].endswith("[speculators-vs-zlab]") or "ours" in r["implementations"]]
    heads = [r for r in rows if r["test"].startswith("conformance/test_dspark_heads.py")]  # its loss: not held yet
    assert len(heads) == 2 and {r["status"] for r in heads} == {"pass"} and all(r["comparisons"] for r in heads), heads
    # Its DSpark loss exists (hf_dspark.py:170) but is not wrapped: n/a with a true reason, never "has no family_loss".
    losses = [r for r in rows if r["test"].startswith("conformance/test_family_losses.py")]
    assert losses and {r["status"] for r in losses} == {"n/a"}, losses
    assert not any("has no family_loss" in r["reason"] for r in losses), [r["reason"] for r in losses]


def test_its_dspark_loss_is_said_not_wrapped(plug):
    from held.modelopt import NOT_WRAPPED_DSPARK_LOSS
    from impl.interface import Unsupported

    where = NOT_WRAPPED_DSPARK_LOSS.split("(")[1].split(",")[0]  # the file:line the message names
    assert "def _compute_dspark_loss(" in source_line(where)
    with pytest.raises(Unsupported, match="DSpark loss .* is not wrapped by this plug"):
        plug.family_loss(None, None, None, None, None, None, 0)


def test_modelopt_plug_takes_every_call(modelopt_results):
    assert modelopt_results["plug_mismatches"] == []
    messages = [(r["diff"] or {}).get("message", "") for r in modelopt_results["components"]]
    assert not any("HeldProcessError: EOFError" in m or "Unsupported" in m for m in messages)
    assert all(r["reason"] for r in modelopt_results["components"] if r["status"] == "n/a")

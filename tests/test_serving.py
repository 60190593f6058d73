"""Will it serve as trained? Drafters written by the references' own writers (z-lab's `save_pretrained`,
speculators' converter and model class) and by our `convert`, held against vLLM 0.33.0 and SGLang 0.5.23
through the engines' own code: exactly the fields each engine runs differently from training."""

from __future__ import annotations

import dataclasses
import json

import pytest
from transformers import Qwen3Config

from dflash_audit.audit.serving import section_dict, serving_section
from dflash_audit.cli import main
from dflash_audit.convert import convert
from held.serving import TargetFacts, resolve
from held.serving.rules import PINNED, RULES, installed_sha256, rule_module
from held.serving.source_exec import compile_definitions, installed_file, line_of
from impl.checkpoint import zlab_config

ENGINES = ["vllm", "sglang"]


def dflash2(spec):
    return dataclasses.replace(spec, conv_kernel_size=3, conv_group_size=8, selector_rank=8, selector_top_k=5,
                               sliding_window_non_causal=True)


def zlab_written(spec, path):
    """z-lab's own writer: its model class's save_pretrained."""
    from dflash.model import DFlash2DraftModel, DFlashDraftModel

    config = Qwen3Config(**zlab_config(spec))
    model = (DFlash2DraftModel if spec.family == "dflash2" else DFlashDraftModel)(config)
    model.save_pretrained(path)
    return path


def divergent_fields(section) -> dict[str, set[str]]:
    return {engine: {f["field"] for f in report["findings"] if f["severity"] == "divergence"}
            for engine, report in section_dict(section).items()}


@pytest.fixture(scope="module")
def written(tmp_path_factory, spec, target_dir):
    """Every writer's directory, both families, mixed sliding + full layers (tiny_spec)."""
    from speculators.convert.dflash import DFlashConverter

    root = tmp_path_factory.mktemp("serving")
    dirs = {}
    for family, family_spec in (("dflash", spec), ("dflash2", dflash2(spec))):
        zlab = dirs[f"zlab save_pretrained {family}"] = zlab_written(family_spec, root / f"zlab-{family}")
        for fmt in ("zlab", "speculators"):
            dirs[f"our convert {fmt} {family}"] = root / f"ours-{fmt}-{family}"
            convert(zlab, root / f"ours-{fmt}-{family}", fmt, target=target_dir)
    DFlashConverter().convert(dirs["zlab save_pretrained dflash"], root / "speculators-dflash",
                              base_model=str(target_dir))
    dirs["speculators converter dflash"] = root / "speculators-dflash"
    return dirs


# What each engine runs differently from training, per writer (the README's table is generated from the
# same check: `python -m dflash_audit.serving_table`).
EXPECTED = {
    "zlab save_pretrained dflash": {"vllm": set(), "sglang": set()},
    "zlab save_pretrained dflash2": {"vllm": {"tensors_refused"}, "sglang": {"tensors_ignored"}},
    "speculators converter dflash": {"vllm": {"layer_causal"}, "sglang": {"loads"}},
    "our convert zlab dflash": {"vllm": set(), "sglang": set()},
    "our convert zlab dflash2": {"vllm": set(), "sglang": set()},
    "our convert speculators dflash": {"vllm": {"layer_causal"}, "sglang": {"loads"}},
    "our convert speculators dflash2": {"vllm": set(), "sglang": {"loads"}},
}


@pytest.mark.parametrize("writer", sorted(EXPECTED))
def test_each_writer_serves_with_exactly_the_known_divergences(writer, written, target_dir):
    section = serving_section(written[writer], ENGINES, target_dir)
    assert divergent_fields(section) == EXPECTED[writer]


def test_speculators_full_layer_runs_causal_in_vllm(written, target_dir):
    """update_dflash turns sliding_window_non_causal=false into dflash_config.causal=true, which
    _dflash_layer_causal applies to every layer: the full-attention layer 1 runs causal."""
    report = section_dict(serving_section(written["speculators converter dflash"], ["vllm"], target_dir))["vllm"]
    (finding,) = [f for f in report["findings"] if f["field"] == "layer_causal"]
    assert finding["trained"] == [True, False, True] and finding["served"] == [True, True, True]
    assert finding["source"].startswith("vllm/model_executor/models/qwen3_dflash.py:")
    assert report["served"]["target_layer_ids"] == [1, 3, 4]  # aux ids [2, 4, 5] read back as z-lab ids


def test_commands_carry_each_engines_speculative_token_convention(written, target_dir):
    section = section_dict(serving_section(written["zlab save_pretrained dflash"], ENGINES, target_dir))
    vllm, sglang = section["vllm"]["command"], section["sglang"]["command"]
    assert vllm.startswith("VLLM_USE_V2_MODEL_RUNNER=1 vllm serve ")  # mixed sliding/full layers
    assert '"method": "dflash"' in vllm and '"num_speculative_tokens": 7' in vllm  # block 8 = bonus + 7
    assert sglang.split()[:3] == ["python", "-m", "sglang.launch_server"]
    assert "--speculative-algorithm DFLASH" in sglang and sglang.endswith("--speculative-num-draft-tokens 8")
    assert section["vllm"]["served"]["block_size"] == section["sglang"]["served"]["block_size"] == 8


def test_engine_rules_are_the_installed_code():
    """Executed rules run the installed file's own bytes (its path and line); restated ones are pinned."""
    defs = compile_definitions("vllm.model_executor.models.qwen3_dflash", ["_SLIDING_ATTENTION", "_dflash_layer_causal"])
    code = defs["_dflash_layer_causal"].__code__
    assert code.co_filename == str(installed_file("vllm.model_executor.models.qwen3_dflash"))
    assert code.co_firstlineno == line_of("vllm.model_executor.models.qwen3_dflash", "def _dflash_layer_causal")
    for rule in RULES:
        assert line_of(rule_module(rule.module), rule.needle) > 0
        if rule.how == "restated":
            assert rule.module in PINNED, f"{rule.module} is restated but not pinned"
    for module, sha in PINNED.items():
        assert installed_sha256(module) == sha, f"{module} changed: re-read the restated rules in held/serving/rules.py"


def test_mask_token_equal_to_eos_is_a_divergence(tmp_path, spec, target_dir):
    config = json.loads((target_dir / "config.json").read_text())
    target = tmp_path / "target"
    target.mkdir()
    for item in target_dir.iterdir():
        (target / item.name).write_bytes(item.read_bytes())
    (target / "config.json").write_text(json.dumps({**config, "eos_token_id": spec.mask_token_id}))
    zlab = zlab_written(spec, tmp_path / "zlab")
    found = section_dict(serving_section(zlab, ENGINES, target))
    for engine in ENGINES:
        assert [f["field"] for f in found[engine]["findings"] if f["severity"] == "divergence"] == ["mask_token_id"]
    without_target = section_dict(serving_section(zlab, ["vllm"], None))["vllm"]
    assert [(f["field"], f["severity"]) for f in without_target["findings"]] == [("mask_token_id", "warning")]


def test_unknown_trained_value_is_a_warning_naming_the_flag(tmp_path, spec, target_dir):
    zlab = zlab_written(spec, tmp_path / "zlab")
    config = json.loads((zlab / "config.json").read_text())
    del config["rope_parameters"]
    (zlab / "config.json").write_text(json.dumps(config))
    report = section_dict(serving_section(zlab, ["sglang"], target_dir))["sglang"]
    (finding,) = [f for f in report["findings"] if f["field"] == "rope_theta"]
    assert finding["severity"] == "warning" and "--spec rope_theta=VALUE" in finding["message"]
    assert finding["trained"] is None and finding["served"] == 10000.0
    given = section_dict(serving_section(zlab, ["sglang"], target_dir,
                                         options=__import__("dflash_audit.formats", fromlist=["LoadOptions"])
                                         .LoadOptions(spec=["rope_theta=1000000"], flag_prefix="")))["sglang"]
    assert [f["field"] for f in given["findings"] if f["severity"] == "divergence"] == ["rope_theta"]


def test_served_ids_without_target_use_the_drafters_record(written):
    served = resolve("vllm", written["zlab save_pretrained dflash"], TargetFacts(), 8, 6)
    assert served.values["target_layer_ids"] == [1, 3, 4] and served.values["target_layer_ids_declared"]


def test_serve_check_cli_exit_status_json_and_html(tmp_path, written, target_dir, capsys):
    clean = main(["serve-check", "--drafter", str(written["zlab save_pretrained dflash"]),
                  "--target", str(target_dir), "--json", str(tmp_path / "clean.json")])
    assert clean == 0
    diverging = main(["serve-check", "--drafter", str(written["speculators converter dflash"]), "--engine", "vllm",
                      "--target", str(target_dir), "--json", str(tmp_path / "s.json"), "--out", str(tmp_path / "o")])
    assert diverging == 1
    data = json.loads((tmp_path / "s.json").read_text())
    vllm = data["serving"]["vllm"]
    assert set(vllm) >= {"version", "loads", "error", "served", "trained", "findings", "command"}
    assert vllm["version"] == "0.33.0" and list(data["serving"]) == ["vllm"]
    assert set(vllm["findings"][0]) >= {"component", "field", "severity", "trained", "served", "source", "message"}
    assert vllm["findings"][0]["component"] == "serving"
    assert 'data-engine="vllm"' in (tmp_path / "o" / "index.html").read_text()
    assert main(["serve-check", "--drafter", str(tmp_path / "nowhere")]) == 2
    assert main(["serve-check", "--drafter", str(written["zlab save_pretrained dflash"]), "--engine", "tgi"]) == 2
    assert "dflash-audit: error:" in capsys.readouterr().err


def test_a_checkpoint_file_points_to_convert_for(tmp_path, spec, drafter):
    from impl.checkpoint import save_checkpoint

    save_checkpoint(tmp_path / "ckpt.pt", drafter)
    report = section_dict(serving_section(tmp_path / "ckpt.pt", ["vllm"]))["vllm"]
    assert not report["loads"] and "--for vllm" in report["error"]

"""serve-check holds each key and file of a drafter folder to what the reference does with it
(serving_engines/key_verdict.py), not only to the value the config declares: keys planted into a copy of the test
world's z-lab drafter folder, each named with what it changes (greedy drafts, sampled drafts only, the weights),
and side files and tensors z-lab's DFlashDraftModel never loads."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from dflash_audit.audit.serving import section_dict, serving_section
from dflash_audit.cli import main
from serving_engines.live.llamacpp_env import source_tree
from serving_engines.reference_behaviour import reference_tensor_names
from serving_engines.source_exec import cite

ENGINES = ["vllm", "sglang"]
# Planted into one folder each: the keys that change sampled drafts only, those that change greedy drafts, files.
FOLDERS = {
    "sampled": ({"logit_scale": 2.0}, {"output_multiplier": 1.5, "final_logit_softcapping": 30.0}),
    "greedy": ({"logit_scale": -1.0, "use_gemma_norm": True, "is_neox_style": False, "target_hidden_size": "double"},
               {"input_embedding_scale": 2.0, "attention_value_scale": 0.5}),
}
# plant -> (its folder, {engine: {finding field: severity}}); an engine left out makes no finding of the plant.
PLANTS = {
    "logit_scale 2.0 changes sampled drafts only": ("sampled", {"vllm": {"config:logit_scale": "warning"}}),
    "dflash_config.output_multiplier 1.5 changes sampled drafts only": ("sampled", {
        engine: {"config:dflash_config.output_multiplier": "warning"} for engine in ENGINES}),
    "dflash_config.final_logit_softcapping 30 changes sampled drafts only": ("sampled", {
        engine: {"config:dflash_config.final_logit_softcapping": "warning"} for engine in ENGINES}),
    "logit_scale -1.0 changes greedy drafts": ("greedy", {"vllm": {"config:logit_scale": "divergence"}}),
    "dflash_config.input_embedding_scale 2.0 changes greedy drafts": ("greedy", {
        "vllm": {"config:dflash_config.input_embedding_scale": "divergence"},
        "sglang": {"input_embedding_scale": "divergence"}}),  # SGLang takes the target's: its field finding
    "dflash_config.attention_value_scale 0.5 changes greedy drafts": ("greedy", {
        engine: {"config:dflash_config.attention_value_scale": "divergence"} for engine in ENGINES}),
    "use_gemma_norm changes greedy drafts": ("greedy", {"sglang": {"config:use_gemma_norm": "divergence"}}),
    "is_neox_style false changes greedy drafts": ("greedy", {engine: {"is_neox_style": "divergence"}
                                                             for engine in ENGINES}),
    "target_hidden_size doubled makes vLLM refuse the weights": ("greedy", {
        "vllm": {"config:target_hidden_size": "divergence"}}),
    "mask_embedding.pt changes greedy drafts": ("files", {"vllm": {"file:mask_embedding.pt": "divergence"}}),
    "an embed_tokens.weight of its own changes greedy drafts": ("files", {
        "vllm": {"tensor:embed_tokens.weight": "divergence"}}),
}


def target_head(target: Path) -> torch.Tensor:
    """The target's output head (its embedding when it ties them)."""
    for file in sorted(target.glob("*.safetensors")):
        with safe_open(str(file), "pt") as handle:
            names = list(handle.keys())
            name = next((n for n in names if n.endswith("lm_head.weight")), None) or \
                next((n for n in names if n.endswith("embed_tokens.weight")), None)
            if name:
                return handle.get_tensor(name)
    raise AssertionError(f"{target}: no head")


def plant(clean: Path, folder: Path, top: dict, dflash: dict) -> Path:
    shutil.copytree(clean, folder)
    config = json.loads((folder / "config.json").read_text())
    config.update({k: 2 * config["hidden_size"] if v == "double" else v for k, v in top.items()})
    config["dflash_config"].update(dflash)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def folders(test_world, tmp_path_factory):
    """The test world's all-full drafter as a z-lab folder (its target layers but the last, which engines capture
    otherwise), and the planted copies: {name: folder}, the world's target."""
    from dflash_world.drafter import cached_full_drafter
    from drafter_files.checkpoint import load_checkpoint
    from drafter_files.zlab_format import save_zlab_dir
    from tests.family_fixtures import without_final_layer

    root = tmp_path_factory.mktemp("key-verdict")
    trained = load_checkpoint(cached_full_drafter(test_world))
    save_zlab_dir(root / "clean", *without_final_layer(trained.spec, trained.state_dict))
    made = {"clean": root / "clean"}
    for name, (top, dflash) in FOLDERS.items():
        made[name] = plant(made["clean"], root / name, top, dflash)
    files = made["files"] = plant(made["clean"], root / "files", {}, {})
    config = json.loads((files / "config.json").read_text())
    torch.manual_seed(0)
    torch.save({"mask_token_id": config["dflash_config"]["mask_token_id"],
                "embedding": torch.randn(config["hidden_size"])}, files / "mask_embedding.pt")
    head = target_head(Path(test_world.target))
    tensors = load_file(files / "model.safetensors")
    tensors["lm_head.weight"] = head.clone()  # the target's own head: vLLM shares it, as z-lab drafts through it
    tensors["embed_tokens.weight"] = torch.randn_like(head)  # an embedding of its own
    save_file(tensors, str(files / "model.safetensors"), metadata={"format": "pt"})
    return made, Path(test_world.target)


@pytest.fixture(scope="module")
def sections(folders):
    made, target = folders
    return {name: section_dict(serving_section(path, ENGINES, target)) for name, path in made.items()}


def by_field(report: dict) -> dict[str, dict]:
    return {f["field"]: f for f in report["findings"]}


def test_the_clean_folder_has_no_key_or_file_finding(sections, folders, capsys):
    for engine in ENGINES:
        fields = set(by_field(sections["clean"][engine]))
        assert not {f for f in fields if f.split(":")[0] in ("config", "file", "tensor")}, fields
    made, target = folders
    assert main(["serve-check", "--drafter", str(made["clean"]), "--target", str(target),
                 "--engine", "vllm,sglang"]) == 0
    capsys.readouterr()


@pytest.mark.parametrize("name", list(PLANTS))
def test_each_planted_key_is_judged_by_what_it_changes(name, sections):
    folder, expected = PLANTS[name]
    fields = {field for found in expected.values() for field in found}
    for engine in ENGINES:
        found = {field: f["severity"] for field, f in by_field(sections[folder][engine]).items() if field in fields}
        assert found == expected.get(engine, {}), (engine, found)


def test_a_key_that_changes_sampled_drafts_only_says_so_with_its_factor(sections, folders, capsys):
    """The issue's repro: vLLM scales the draft logits by logit_scale, z-lab never reads it. Greedy drafts are
    unchanged, sampled ones are drawn as if at another temperature: a warning saying exactly that, never a silent
    "serves as trained", and not a divergence (exit 0)."""
    from serving_engines.source_exec import line_of

    finding = by_field(sections["sampled"]["vllm"])["config:logit_scale"]
    line = line_of("vllm.model_executor.models.qwen3_dflash", 'logit_scale = getattr(self.config, "logit_scale"')
    assert finding["source"] == f"vllm/model_executor/models/qwen3_dflash.py:{line}"
    assert (finding["trained"], finding["served"]) == (1.0, 2.0)
    for words in ("vLLM reads logit_scale = 2.0", "z x 2 where the reference's are z x 1",
                  "greedy drafts are unchanged", "sampled drafts change", "T x 0.5",
                  cite("dflash.model", 'logits = logits * float(_draft_value(self.config, "output_multiplier"')):
        assert words in finding["message"]
    made, target = folders
    assert main(["serve-check", "--drafter", str(made["sampled"]), "--target", str(target), "--engine", "vllm"]) == 0
    out = capsys.readouterr().out
    assert "serves as trained" not in out and "greedy drafts are unchanged" in " ".join(out.split())


def test_keys_that_change_greedy_drafts_fail_the_check(sections, folders, capsys):
    value = by_field(sections["greedy"]["vllm"])["config:dflash_config.attention_value_scale"]
    assert "greedy drafts change" in value["message"] and "never" not in value["message"]
    multiplier = by_field(sections["sampled"]["sglang"])["config:dflash_config.output_multiplier"]
    assert "SGLang never reads dflash_config.output_multiplier = 1.5 and runs it as 1.0" in multiplier["message"]
    neox = by_field(sections["greedy"]["sglang"])["is_neox_style"]
    assert (neox["trained"], neox["served"]) == (True, False) and "rotate_half" in neox["message"]
    made, target = folders
    assert main(["serve-check", "--drafter", str(made["greedy"]), "--target", str(target), "--engine", "vllm"]) == 1
    capsys.readouterr()


def test_files_the_reference_never_loads(sections, folders):
    """z-lab's class builds no lm_head or embed_tokens (it drafts through the target's) and never opens
    mask_embedding.pt; vLLM loads all three, and shares the head only where it equals the target's."""
    made, target = folders
    config = json.loads((made["files"] / "config.json").read_text())
    built = reference_tensor_names(config)
    assert "fc.weight" in built and not {"lm_head.weight", "embed_tokens.weight"} & built
    vllm = by_field(sections["files"]["vllm"])
    assert "tensor:lm_head.weight" not in vllm  # equal to the target's: vLLM drafts through the target's head
    assert "differs from the target's" in vllm["tensor:embed_tokens.weight"]["message"]
    assert "mask_embedding.pt" in vllm["file:mask_embedding.pt"]["message"]
    unknown = section_dict(serving_section(made["files"], ["vllm"], None))["vllm"]
    assert by_field(unknown)["tensor:embed_tokens.weight"]["severity"] == "warning"  # no target: unknown


def test_vllm_drafts_greedily_at_every_temperature(sections):
    finding = by_field(sections["clean"]["vllm"])["draft_sampling"]
    assert (finding["severity"], finding["served"]) == ("info", "argmax")
    assert finding["source"].startswith("vllm/config/speculative.py:")
    assert "draft_sample_method='probabilistic'" in finding["message"]
    assert cite("dflash.model", "block_output_ids[:, 1:] = _sample_probs(draft_probs)") in finding["message"]


@pytest.mark.skipif(not (source_tree() / "convert_hf_to_gguf.py").is_file() and not os.environ.get("CI"),
                    reason="run `make setup` to unpack and build llama.cpp b11434")
def test_llamacpps_converter_is_held_to_the_reference_too(folders, tmp_path):
    """The converter writes dflash_config.attention_value_scale into the GGUF and embeds mask_embedding.pt's vector;
    it rotates neox style whatever is_neox_style says, as z-lab does, so that plant is no finding for it."""
    made, target = folders
    both = plant(made["greedy"], tmp_path / "both", {}, {})
    shutil.copy(made["files"] / "mask_embedding.pt", both / "mask_embedding.pt")
    report = section_dict(serving_section(both, ["llamacpp"], target))["llamacpp"]
    found = {field: f["severity"] for field, f in by_field(report).items()}
    assert found["config:dflash_config.attention_value_scale"] == "divergence"
    assert found["file:mask_embedding.pt"] == "divergence"
    assert "is_neox_style" not in found and "config:logit_scale" not in found

"""Planted serving bugs: a drafter directory written correctly (z-lab format, our writer) and then broken the way
users' checkpoints are, each caught by the serving check (`serving_engines.verdict`) for the engine and field named.
The trained spec is the one the directory was written from: the check must find what the engine runs differently.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from impl.families import ZLAB_ARCHITECTURES
from impl.layers import zlab_to_speculators
from impl.spec import DraftSpec
from drafter_files.zlab_format import save_zlab_dir
from serving_engines import TargetFacts
from serving_engines.verdict import EngineReport, engine_report

# Two sliding layers around a full one, ids of a 6-layer target: every serving rule has something to act on.
SPEC = DraftSpec(hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                 num_hidden_layers=3, target_vocab_size=96, target_layer_ids=(1, 3, 4), num_target_layers=6,
                 mask_token_id=95, block_size=4, rope_theta=1e6,  # Qwen3's own θ, as published drafters declare
                 layer_types=("sliding_attention", "full_attention", "sliding_attention"), sliding_window=5)


@dataclass(frozen=True)
class PlantedServingBug:
    name: str
    pitfall: int
    engine: str
    field: str  # the finding field that must report it
    plant: Callable[[Path, dict], None]  # (drafter dir, target facts as a dict) -> mutate in place


def _edit_config(change: Callable[[dict], None]) -> Callable[[Path, dict], None]:
    def plant(path: Path, _target: dict) -> None:
        config = json.loads((path / "config.json").read_text())
        change(config)
        (path / "config.json").write_text(json.dumps(config))
    return plant


def _ids_in_speculators_convention(config: dict) -> None:
    ids = config["dflash_config"]["target_layer_ids"]
    config["dflash_config"]["target_layer_ids"] = zlab_to_speculators(ids, config["num_target_layers"] + 1)


def _causal_everywhere(config: dict) -> None:
    config["is_causal"] = True  # meant for the sliding layers; both engines apply it to every layer


def _ids_dropped(config: dict) -> None:
    config["dflash_config"].pop("target_layer_ids")
    config.pop("target_layer_ids", None)


def _rope_dropped(config: dict) -> None:
    config.pop("rope_parameters", None)
    config.pop("rope_theta", None)


def _mask_is_eos(_path: Path, target: dict) -> None:
    target["eos_token_ids"] = [SPEC.mask_token_id]  # the target's eos is the id the drafter was trained with


def _speculative_tokens_is_block(config: dict) -> None:
    """A speculators directory that records SGLang's count (the block) where vLLM wants block - 1."""
    aux = zlab_to_speculators(config["dflash_config"]["target_layer_ids"], config["num_target_layers"])
    layer = {k: v for k, v in config.items() if k not in ("dflash_config", "architectures", "num_target_layers",
                                                           "block_size")}
    config.clear()
    config.update(speculators_model_type="dflash", architectures=[ZLAB_ARCHITECTURES["dflash"]], transformer_layer_config=layer,
                  aux_hidden_state_layer_ids=aux, mask_token_id=SPEC.mask_token_id, block_size=SPEC.block_size,
                  sliding_window_non_causal=False, draft_vocab_size=SPEC.target_vocab_size,
                  speculators_config={"algorithm": "dflash", "proposal_methods": [
                      {"proposal_type": "greedy", "speculative_tokens": SPEC.block_size}],
                      "default_proposal_method": "greedy",
                      "verifier": {"name_or_path": "target", "architectures": ["Qwen3ForCausalLM"]}})


def _partial_rotary_leaked(config: dict) -> None:
    config["rope_parameters"] = {**config["rope_parameters"], "partial_rotary_factor": 0.5}


def _value_scale_from_another_recipe(config: dict) -> None:
    """A key z-lab's DFlashDraftModel never reads and both engines apply to every draft layer's values."""
    config["dflash_config"]["attention_value_scale"] = 0.5


def _gemma_norm_flag(config: dict) -> None:
    config["use_gemma_norm"] = True  # SGLang's norms become Gemma's (x (1 + w)); z-lab never reads the key


SERVING_BUGS = [
    PlantedServingBug("layer ids written in the speculators convention", 26, "vllm", "target_layer_ids",
                      _edit_config(_ids_in_speculators_convention)),
    PlantedServingBug("layer ids written in the speculators convention (SGLang)", 26, "sglang", "target_layer_ids",
                      _edit_config(_ids_in_speculators_convention)),
    PlantedServingBug("no layer ids: vLLM guesses", 26, "vllm", "target_layer_ids", _edit_config(_ids_dropped)),
    PlantedServingBug("no layer ids: SGLang guesses", 26, "sglang", "target_layer_ids", _edit_config(_ids_dropped)),
    PlantedServingBug("is_causal applied to the full layer", 27, "vllm", "layer_causal",
                      _edit_config(_causal_everywhere)),
    PlantedServingBug("is_causal applied to the full layer (SGLang)", 27, "sglang", "layer_causal",
                      _edit_config(_causal_everywhere)),
    PlantedServingBug("mask token equal to the target's eos", 28, "sglang", "mask_token_id", _mask_is_eos),
    PlantedServingBug("speculative tokens = block size for vLLM", 29, "vllm", "block_size",
                      _edit_config(_speculative_tokens_is_block)),
    PlantedServingBug("rope defaulted by SGLang (10000)", 30, "sglang", "rope_theta", _edit_config(_rope_dropped)),
    PlantedServingBug("partial rotary leaked from the target", 30, "vllm", "partial_rotary_factor",
                      _edit_config(_partial_rotary_leaked)),
    PlantedServingBug("attention value scale z-lab never reads", 31, "vllm",
                      "config:dflash_config.attention_value_scale", _edit_config(_value_scale_from_another_recipe)),
    PlantedServingBug("Gemma norm flag z-lab never reads (SGLang)", 31, "sglang", "config:use_gemma_norm",
                      _edit_config(_gemma_norm_flag)),
]


def target_facts(**changes) -> TargetFacts:
    """The runtime target of SPEC: its depth and vocabulary (eos/pad none unless a bug plants one)."""
    facts = TargetFacts(path=None, num_layers=SPEC.num_target_layers, vocab_size=SPEC.target_vocab_size,
                        embedding_rows=SPEC.target_vocab_size)
    return dataclasses.replace(facts, **changes)


def served_report(bug: PlantedServingBug | None, engine: str, root: Path, state_dict: dict) -> EngineReport:
    """Write SPEC's drafter (our z-lab writer), plant `bug`, and hold `engine` to the trained SPEC."""
    path = root / (bug.name.replace(" ", "_").replace(":", "").replace("'", "") if bug else "clean")
    shutil.rmtree(path, ignore_errors=True)
    save_zlab_dir(path, SPEC, state_dict)
    target = {}
    if bug is not None:
        bug.plant(path, target)
    return engine_report(engine, str(path), SPEC, target_facts(**target))

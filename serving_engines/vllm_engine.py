"""vLLM 0.33.0 reading a DFlash / DFlash2 drafter directory (z-lab or speculators format), and speculators' DSpark
and XPress directories (their heads' rules: `vllm_family.py`).

Called: `SpeculatorsConfig` (config translation, `update_dflash` / `update_dflash2` through it, and
`build_vllm_speculative_config`), `get_eagle3_aux_layers_from_config`, `set_default_rope_theta`.
Executed from the installed source: `_dflash_layer_causal` and `_resolve_layer_attention` (qwen3_dflash.py
imports vLLM's kernels) and the target's default aux layers. Restated (pinned): see `rules.py`.
"""

from __future__ import annotations

import copy
import json
import shlex
from functools import lru_cache
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from foundation.packages import installed_version
from impl.families import config_family
from foundation.inputs import openable
from foundation.param_names import codebook_name
from serving_engines import rules, vllm_family
from serving_engines.layer_capture import vllm_capture
from serving_engines.served import Served, TargetFacts
from serving_engines.source_exec import compile_definitions

ENGINE = "vllm"
DFLASH2_KEYS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")


@lru_cache(maxsize=1)
def _attention_rules():
    from transformers import Qwen3Config

    runner = SimpleNamespace(use_v2_model_runner=False)
    defs = compile_definitions(rules.VLLM_DFLASH, ["_SLIDING_ATTENTION", "_dflash_layer_causal",
                                                   "_resolve_layer_attention"],
                               {"Qwen3Config": Qwen3Config, "get_current_vllm_config": lambda: runner})
    return defs, runner


@lru_cache(maxsize=1)
def _default_aux_layers():
    return compile_definitions("vllm.model_executor.models.interfaces",
                               ["SupportsEagle3.get_eagle3_default_aux_hidden_state_layers"])[
        "get_eagle3_default_aux_hidden_state_layers"]


@lru_cache(maxsize=1)
def default_draft_sampling() -> str:
    """SpeculativeConfig's `draft_sample_method` default, read off the installed config/speculative.py (importing
    it takes seconds): 'greedy' drafts the argmax, 'probabilistic' samples the draft distribution."""
    import ast

    from serving_engines.source_exec import installed_file

    tree = ast.parse(installed_file(rules.VLLM_SPEC_CONFIG).read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == "SpeculativeConfig":
            for item in node.body:
                if isinstance(item, ast.AnnAssign) and getattr(item.target, "id", None) == "draft_sample_method":
                    return ast.literal_eval(item.value)
    raise ValueError("SpeculativeConfig.draft_sample_method not found in the installed vLLM")


def hf_config(path: Path, config: dict[str, Any]):
    """The HF config vLLM builds the drafter from (speculators: its own translation)."""
    if config.get("speculators_model_type"):
        from vllm.transformers_utils.configs.speculators.base import SpeculatorsConfig

        return SpeculatorsConfig.from_pretrained(str(path))
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(path), trust_remote_code=False)


def speculative_tokens(config: dict[str, Any]) -> int | None:
    """A speculators directory's own count (vLLM validates the structure first); None for z-lab."""
    if not config.get("speculators_model_type"):
        return None
    from vllm.transformers_utils.configs.speculators.base import SpeculatorsConfig

    return int(SpeculatorsConfig.extract_vllm_speculative_config(config)["num_speculative_tokens"])


def layer_attention(hf) -> tuple[list[int | None], list[bool], bool]:
    """(window per layer, causal per layer, needs the V2 runner) by vLLM's own resolution."""
    defs, runner = _attention_rules()
    needs_v2 = False
    runner.use_v2_model_runner = False
    try:
        resolved = [defs["_resolve_layer_attention"](hf, i) for i in range(hf.num_hidden_layers)]
    except NotImplementedError:  # mixed sliding/full: only the V2 runner serves it
        needs_v2, runner.use_v2_model_runner = True, True
        resolved = [defs["_resolve_layer_attention"](hf, i) for i in range(hf.num_hidden_layers)]
    return [w for w, _ in resolved], [bool(c) for _, c in resolved], needs_v2


def captured_layer_ids(hf, target_layers: int | None) -> tuple[list[int] | None, bool]:
    """(z-lab ids of the target layers vLLM feeds the drafter, declared by the config)."""
    from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import (
        get_eagle3_aux_layers_from_config,
    )

    spec_config = SimpleNamespace(draft_model_config=SimpleNamespace(hf_config=hf))
    aux = get_eagle3_aux_layers_from_config(spec_config)
    if aux:
        return aux_to_zlab(aux), True
    if target_layers is None:
        return None, False
    model = SimpleNamespace(model=SimpleNamespace(layers=range(target_layers)))
    return aux_to_zlab(_default_aux_layers()(model)), False


def aux_to_zlab(aux) -> list[int]:
    """vLLM's aux ids as z-lab ids (aux - 1), whatever they are: aux 0 is the embedding output (z-lab -1), and an aux
    id outside 0..N (the default (2, N//2, N-3) of a shallow target) is never captured (`capture.vllm_capture`)."""
    return [int(j) - 1 for j in aux]


def rope(hf) -> dict[str, Any]:
    from vllm.transformers_utils.config import set_default_rope_theta

    hf = copy.deepcopy(hf)
    set_default_rope_theta(hf, default_theta=1000000)  # what DFlashQwen3DecoderLayer does first
    params = dict(hf.rope_parameters)
    return {"rope_theta": float(params["rope_theta"]), "rope_type": params.get("rope_type", "default"),
            "partial_rotary_factor": float(params.get("partial_rotary_factor", 1.0)),
            "is_neox_style": bool(getattr(hf, "is_neox_style", True))}


def tensor_names(path: Path) -> list[str]:
    from safetensors import safe_open

    return [n for f in sorted(path.glob("*.safetensors")) for n in safe_open(openable(f), "pt").keys()]


def tensors(path: Path, family: str) -> tuple[list[str], list[str]]:
    """(ignored, refused) tensor names: vLLM's DFlash2 codebooks are bare parameters, so a `.weight` name
    is a nested weight its loader refuses."""
    names = tensor_names(path)
    refused = [n for n in names if family == "dflash2" and codebook_name(n) != n]
    return [], sorted(refused)


def command(path: Path, target: str | None, k: int | None, needs_v2: bool, method: str = "dflash") -> str:
    spec = {"method": method, "model": str(path)}
    if k is not None:
        spec["num_speculative_tokens"] = k
    env = "VLLM_USE_V2_MODEL_RUNNER=1 " if needs_v2 else ""
    return f"{env}vllm serve {shlex.quote(target or '<target>')} --speculative-config {shlex.quote(json.dumps(spec))}"


def xpress(path: Path, config: dict[str, Any], target: TargetFacts, served: Served, error: str) -> Served:
    """A speculators XPress directory: refused by the config translation; what the XPress files would read."""
    values = vllm_family.xpress_values(config, tensor_names(path),
                                       target.vocab_size or config.get("transformer_layer_config", {}).get("vocab_size"))
    served.loads, served.error, served.values, served.config_refused = False, error, values, True
    served.notes += [*vllm_family.xpress_notes(config), vllm_family.v2_note("XPress")]
    served.sources = {name: rules.source(ENGINE, name, "xpress") for name in ("loads", *values)}
    k = speculative_tokens(config)
    served.command = command(path, target.path, k, True)
    return served


def resolve(path: Path, target: TargetFacts, trained_block_size: int | None,
            num_target_layers: int | None = None) -> Served:
    served = Served(ENGINE, installed_version("vllm"), loads=True)
    config = json.loads((path / "config.json").read_text())
    family = config_family(config)
    refusal = vllm_family.untranslated(config["speculators_model_type"]) if config.get("speculators_model_type") \
        else None
    if refusal and family == "xpress":
        return xpress(path, config, target, served, refusal)
    if refusal:
        served.loads, served.error = False, refusal
        return served
    try:
        k_from_config = speculative_tokens(config)
        hf = hf_config(path, config)
        windows, causal, needs_v2 = layer_attention(hf)
    except Exception as exc:  # noqa: BLE001 -- the engine's own refusal, reported as such
        served.loads, served.error = False, f"{type(exc).__name__}: {exc}"
        return served
    k = k_from_config if k_from_config is not None else (trained_block_size - 1 if trained_block_size else None)
    ids, declared = captured_layer_ids(hf, target.num_layers or num_target_layers)
    dflash = dict(getattr(hf, "dflash_config", None) or {})
    anchor_sampled = bool(dflash.get("sample_from_anchor", False))
    dspark, refused_heads = vllm_family.dspark_values(hf, k, tensor_names(path)) if family == "dspark" else ({}, [])
    if family == "dspark":
        anchor_sampled = dspark["sample_from_anchor"]
    elif anchor_sampled:  # the DFlash runner refuses it before drafting anything: no block is served
        served.loads, served.refused_for = False, "sample_from_anchor"
        served.error = ("its DFlash runner refuses sample_from_anchor=True (only the DSpark runner samples from the "
                        "anchor)")
        k = None
    values: dict[str, Any] = {
        "target_layer_ids": ids, "target_layer_ids_declared": declared,
        "layer_types": ["sliding_attention" if w is not None else "full_attention" for w in windows],
        "layer_windows": windows, "layer_causal": causal,
        "mask_token_id": dflash.get("mask_token_id", getattr(hf, "mask_token_id", None)),
        "num_speculative_tokens": k, "block_size": None if k is None else 1 + k,
        **rope(hf),
        "rms_norm_eps": float(hf.rms_norm_eps), "hidden_act": hf.hidden_act, "vocab_size": hf.vocab_size,
        "draft_vocab_size": getattr(hf, "draft_vocab_size", None) or hf.vocab_size,
        "sample_from_anchor": anchor_sampled,
        "target_layer_capture": vllm_capture(ids, target.num_layers or num_target_layers),
        "draft_sampling": "argmax" if default_draft_sampling() == "greedy" else "sampled",
    }
    values.update(dspark)
    if family == "dflash2":
        softcap = float(dflash.get("final_logit_softcapping") or 0.0)
        values.update({key: dflash.get(key) for key in DFLASH2_KEYS})
        values.update(input_embedding_scale=float(dflash.get("input_embedding_scale", 1.0)),
                      output_multiplier=float(dflash.get("output_multiplier", 1.0)),
                      final_logit_softcapping=softcap if softcap > 0 else None)
    ignored, refused = tensors(path, family)
    values.update(tensors_ignored=ignored, tensors_refused=refused)
    # A head smaller than the target's vocabulary maps through a `d2t` tensor when the files hold one; else its
    # zero-initialized offsets stay: draft id k is read as target token k.
    reduced = values["draft_vocab_size"] != (target.vocab_size or hf.vocab_size)
    values["draft_to_target"] = "d2t" if reduced and "d2t" in tensor_names(path) else "identity"
    if refused_heads:  # one root cause: the head vLLM builds; its refused tensors are that finding's detail
        values["tensors_refused"] = refused_heads
        served.loads, served.refused_for, served.covered = False, "markov_head_type", ["tensors_refused"]
        served.error = vllm_family.dspark_refusal(refused_heads)
    elif refused:
        served.loads = False
        served.error = (f"ValueError: Attempted to load nested weight 'model.{refused[0]}' into a single parameter "
                        f"'model.{refused[0].removesuffix('.weight')}' (vLLM's AutoWeightsLoader)")
    if needs_v2:
        served.notes.append("mixed sliding/full layers: vLLM serves them only with VLLM_USE_V2_MODEL_RUNNER=1")
    if not declared and ids is not None:
        served.notes.append("the config declares no target layer ids: vLLM uses the target model's default aux "
                            "layers")
    if family == "dspark":
        served.notes.append(vllm_family.v2_note("DSpark"))
    served.values = values
    own = family if family in ("dspark", "xpress") else None
    served.sources = {name: rules.source(ENGINE, name, own) for name in values if rules.source(ENGINE, name, own)}
    served.command = command(path, target.path, k, needs_v2 or family == "dspark",
                             "dspark" if family == "dspark" else "dflash")
    return served

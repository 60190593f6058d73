"""SGLang 0.5.23 reading a DFlash / DFlash2 drafter directory. It reads the z-lab format only (its config is
built by transformers' AutoConfig, which has no speculators config type); every DFlash module of SGLang imports
its GPU kernels, so its rules are executed from the installed source (`source_exec.py`) or restated (pinned).
"""

from __future__ import annotations

import enum
import json
import logging
import shlex
from functools import lru_cache
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from foundation.inputs import openable
from foundation.packages import installed_version
from impl.families import config_family
from foundation.param_names import codebook_name
from serving_engines import rules
from serving_engines.layer_capture import sglang_capture
from serving_engines.served import Served, TargetFacts
from serving_engines.source_exec import cite, compile_definitions

ENGINE = "sglang"
UTILS_NAMES = ["DEFAULT_DFLASH_MASK_TOKEN", "build_target_layer_ids", "get_dflash_layer_types",
               "get_dflash_attention_sliding_window_size", "_cfg_get", "_get_text_config", "_get_dflash_config",
               "is_nemotron_35_draft_config", "_parse_optional_int", "DFlashDraftConfig", "parse_dflash_draft_config"]
SUPPORTED_ACTIVATIONS = ("silu", "swigluoai")  # models/dflash.py: DFlashMLP


class AttentionType(enum.Enum):
    """Stands in for sglang.srt.layers.radix_attention.AttentionType (its module imports the kernels)."""

    DECODER = "decoder"
    ENCODER_ONLY = "encoder_only"


@lru_cache(maxsize=1)
def _utils():
    return compile_definitions(rules.SGL_UTILS, UTILS_NAMES)


@lru_cache(maxsize=1)
def _model_rules():
    utils = _utils()
    return compile_definitions(rules.SGL_MODEL, ["_get_dflash_attention_type", "_get_dflash_layer_attention_params"],
                               {"AttentionType": AttentionType, "Tuple": tuple,
                                "get_dflash_layer_types": utils["get_dflash_layer_types"],
                                "get_dflash_attention_sliding_window_size":
                                    utils["get_dflash_attention_sliding_window_size"]})


@lru_cache(maxsize=1)
def _rope_config():
    return compile_definitions("sglang.srt.utils.hf_transformers.common", ["get_rope_config"])["get_rope_config"]


@lru_cache(maxsize=1)
def _mask_resolver():
    parallel = SimpleNamespace(tp_rank=0)
    return compile_definitions(rules.SGL_WORKER, ["DFlashWorkerV2._resolve_mask_token_id"],
                               {"logger": logging.getLogger("serving_engines.sglang"),
                                "get_parallel": lambda: parallel})["_resolve_mask_token_id"]


def hf_config(path: Path):
    """SGLang's get_config: transformers' AutoConfig, never trusting remote code."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(path), trust_remote_code=False)


def layer_attention(hf) -> tuple[list[str], list[int | None], list[bool]]:
    params = _model_rules()["_get_dflash_layer_attention_params"]
    types, windows, causal = [], [], []
    for i in range(hf.num_hidden_layers):
        window_left, kind = params(hf, i)
        # SGLang stores window_left = W - 1 (HF windows include the current token): back to W.
        windows.append(None if window_left < 0 else window_left + 1)
        types.append("full_attention" if window_left < 0 else "sliding_attention")
        causal.append(kind is AttentionType.DECODER)
    return types, windows, causal


def mask_token(draft, target: TargetFacts) -> int | None:
    """SGLang's own resolution against the target's vocabulary and tokenizer; unknown without --target
    unless the config gives the id."""
    if target.vocab_size is None:
        return draft.mask_token_id
    from transformers import AutoTokenizer

    tokenizer = None
    if target.path is not None and Path(target.path).is_dir():
        try:
            tokenizer = AutoTokenizer.from_pretrained(target.path)
        except (OSError, ValueError):  # a target folder without a tokenizer: SGLang then checks the id alone
            tokenizer = None
    worker = SimpleNamespace(target_worker=SimpleNamespace(
        tokenizer=tokenizer, model_runner=SimpleNamespace(model_config=SimpleNamespace(vocab_size=target.vocab_size))))
    return _mask_resolver()(worker, mask_token=draft.mask_token, mask_token_id=draft.mask_token_id)


def rope(hf, declared: dict[str, Any] | None = None) -> dict[str, Any]:
    """SGLang's rotary settings. `declared`: config.json as written. A fresh SGLang process's AutoConfig keeps its
    top-level `partial_rotary_factor` as an attribute; in this long-lived process another library's earlier use of
    transformers can leave it only inside rope_parameters, so the file's top-level field is what SGLang's getattr
    reads."""
    theta, scaling = _rope_config()(hf)
    partial = float((declared or {}).get("partial_rotary_factor", getattr(hf, "partial_rotary_factor", 1.0)))
    if scaling is not None and "rope_dim" in scaling:
        partial = float(scaling["rope_dim"]) / hf.head_dim
    return {"rope_theta": float(theta), "rope_type": (scaling or {}).get("rope_type", "default"),
            "partial_rotary_factor": partial,
            "is_neox_style": bool(getattr(hf, "rope_is_neox_style", getattr(hf, "is_neox_style", True)))}


def tensors(path: Path, family: str) -> list[str]:
    """Names SGLang's load_weights finds no parameter for and drops silently: the DFlash2 codebooks are bare
    parameters (`predecessor_codebook`), so a `.weight` name is ignored."""
    from safetensors import safe_open

    names = [n for f in sorted(path.glob("*.safetensors")) for n in safe_open(openable(f), "pt").keys()]
    return sorted(n for n in names if family == "dflash2" and codebook_name(n) != n)


def command(path: Path, target: str | None, block_size: int | None) -> str:
    parts = ["python", "-m", "sglang.launch_server", "--model-path", target or "<target>",
             "--speculative-algorithm", "DFLASH", "--speculative-draft-model-path", str(path)]
    if block_size is not None:
        parts += ["--speculative-num-draft-tokens", str(block_size)]
    return " ".join(shlex.quote(p) if not p.startswith("<") else p for p in parts)


def family_note(path: Path) -> str | None:
    """What SGLang has for a DSpark or XPress drafter (its DFLASH reading does not apply to them)."""
    family = config_family(json.loads((path / "config.json").read_text()))
    if family == "dspark":
        return (f"SGLang 0.5.23 serves DSpark with --speculative-algorithm DSPARK "
                f"({cite(rules.SGL_SPEC_INFO, 'DSPARK = auto()')}; models/dspark.py: vanilla, gated and rnn Markov "
                "heads), its draft config read by transformers' AutoConfig as for DFLASH: a speculators directory has "
                "no model_type, and speculators writes no other DSpark format")
    if family == "xpress":
        return "SGLang 0.5.23 has no XPress: no speculative algorithm, model file or config key of it"
    return None


def resolve(path: Path, target: TargetFacts, trained_block_size: int | None,
            num_target_layers: int | None = None) -> Served:
    served = Served(ENGINE, installed_version("sglang"), loads=True)
    note = family_note(path)
    if note:
        served.notes.append(note)
    try:
        hf = hf_config(path)
        draft = _utils()["parse_dflash_draft_config"](draft_hf_config=hf)
        types, windows, causal = layer_attention(hf)
        if getattr(hf, "hidden_act", "silu") not in SUPPORTED_ACTIVATIONS:
            raise ValueError(f"Unsupported DFlash activation: {hf.hidden_act}.")
        mask = mask_token(draft, target)
    except Exception as exc:  # noqa: BLE001 -- the engine's own refusal, reported as such
        served.loads, served.error = False, f"{type(exc).__name__}: {exc}"
        return served
    runtime_layers = target.num_layers or num_target_layers
    declared = draft.target_layer_ids is not None
    ids = None
    if declared or runtime_layers is not None:
        try:
            ids = draft.resolve_target_layer_ids(target_num_layers=runtime_layers or max(draft.target_layer_ids) + 1,
                                                 draft_num_layers=hf.num_hidden_layers)
        except ValueError as exc:
            served.loads, served.error = False, f"ValueError: {exc}"
            return served
    # The command passes the trained block; without one SGLang takes the config's, else 16.
    block = trained_block_size or draft.resolve_block_size(default=None) or 16
    values: dict[str, Any] = {
        "target_layer_ids": ids, "target_layer_ids_declared": declared,
        "layer_types": types, "layer_windows": windows, "layer_causal": causal,
        "mask_token_id": mask, "block_size": block, "num_speculative_tokens": block,
        **rope(hf, json.loads((Path(path) / "config.json").read_text())), "rms_norm_eps": float(getattr(hf, "rms_norm_eps", 1e-6)),
        "hidden_act": getattr(hf, "hidden_act", "silu"), "vocab_size": hf.vocab_size, "draft_vocab_size": hf.vocab_size,
        "sample_from_anchor": False,  # its DFlash config has no slot layout (parse_dflash_draft_config)
        "target_layer_capture": sglang_capture(ids, runtime_layers),
    }
    family = "dflash2" if draft.conv_kernel_size or draft.selector_rank else "dflash"
    if family == "dflash2":
        values.update(conv_kernel_size=draft.conv_kernel_size or None, conv_group_size=draft.conv_group_size or None,
                      selector_rank=draft.selector_rank or None, selector_top_k=draft.selector_top_k or None,
                      output_multiplier=draft.output_multiplier,
                      final_logit_softcapping=draft.final_logit_softcapping)
    # The noise-embedding scale comes from the target model (get_dflash_noise_embedding_scale), never the draft.
    values["input_embedding_scale"] = 1.0
    values.update(tensors_ignored=tensors(path, family), tensors_refused=[])
    if not declared and ids is not None:
        served.notes.append("the config declares no target layer ids: SGLang guesses them with "
                            "build_target_layer_ids(runtime target layers, draft layers)")
    served.values = values
    served.sources = {name: rules.source(ENGINE, name) for name in values if rules.source(ENGINE, name)}
    served.command = command(path, target.path, block)
    return served

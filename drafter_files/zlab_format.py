"""z-lab's drafter format: a Hugging Face folder with a Qwen3 `config.json` plus `dflash_config`, and
`model.safetensors`.

`zlab_config` writes the config, `spec_from_zlab_config` reads one the way
`dflash.model.DFlashDraftModel` does, `save_zlab_dir` writes the folder atomically and `read_zlab_dir` reads it
back (config, spec, weights). A DFlash2 folder says `architectures: ["DFlash2DraftModel"]` and keeps the
convolution and selector sizes in `dflash_config`. It lives below the format readers because the adapters, the held
codebases and the conformance world build z-lab models from our settings; dflash_audit/formats/zlab.py adds what the
audit needs (detection, each field's provenance).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from foundation.atomic import atomic_directory
from foundation.config_values import as_bool, as_float, as_int
from impl.defaults import (
    BLOCK_SIZE_DEFAULTS,
    QWEN3_DEFAULTS,
    ROTARY_DEFAULTS,
    ZLAB_EXTRAS,
)
from foundation.errors import CheckpointError, plain_reason
from impl.families import ZLAB_ARCHITECTURES, config_family
from impl.layers import build_target_layer_ids
from impl.rotary_config import rotary_settings
from foundation.param_names import codebook_names, strip_wrapper_prefixes
from foundation.weights_dir import read_config, read_safetensors_dir
from impl.spec import DFLASH2_FIELDS, DraftSpec, SpecError


def zlab_config(spec: DraftSpec) -> dict[str, Any]:
    """config.json of a z-lab drafter: Qwen3 fields plus `dflash_config`."""
    config = spec.qwen3_config().to_dict()
    config.update({
        "architectures": [ZLAB_ARCHITECTURES[spec.family]],
        "num_target_layers": spec.num_target_layers,
        "block_size": spec.block_size,
        "dflash_config": {
            "target_layer_ids": list(spec.target_layer_ids),
            "mask_token_id": spec.mask_token_id,
            "block_size": spec.block_size,
        },
    })
    for name, default in ZLAB_EXTRAS.items():
        if getattr(spec, name) != default:
            config["dflash_config"][name] = getattr(spec, name)
    if spec.family == "dflash2":
        config["dflash_config"].update({name: getattr(spec, name) for name in DFLASH2_FIELDS})
    if spec.sliding_window_non_causal:
        config["is_causal"] = False  # z-lab's switch: sliding layers then see their whole block
    if spec.reduced_vocab:
        # Where vLLM's DFlash drafter reads it (`hf_config.draft_vocab_size`), beside its `d2t` tensor and own
        # `lm_head.weight`. z-lab's own package has no draft vocabulary.
        config["draft_vocab_size"] = spec.draft_vocab_size
    if spec.sample_from_anchor:
        # Where vLLM's DFlash runner reads the layout from a z-lab directory (it refuses True there);
        # written only when set, so an anchor-as-bonus drafter's config reads as z-lab's own.
        config["dflash_config"]["sample_from_anchor"] = True
    if spec.partial_rotary_factor != ROTARY_DEFAULTS["partial_rotary_factor"]:
        # Beside rope_parameters' (transformers, vLLM): SGLang reads the top-level one (#30).
        config["partial_rotary_factor"] = spec.partial_rotary_factor
    return config


def save_zlab_dir(path: str | Path, spec: DraftSpec, state_dict: dict[str, torch.Tensor]) -> None:
    tensors = {k: v.detach().cpu().contiguous() for k, v in strip_wrapper_prefixes(state_dict).items()}

    def fill(tmp: Path) -> None:
        (tmp / "config.json").write_text(json.dumps(zlab_config(spec), indent=2, sort_keys=True))
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})

    atomic_directory(Path(path), fill)


def read_zlab_dir(path: Path) -> tuple[dict[str, Any], DraftSpec, dict[str, torch.Tensor]]:
    """A z-lab folder read back: its config.json as written, the spec it declares and its weights, the codebooks
    under either spelling z-lab writes."""
    config = read_config(path)
    spec = spec_from_zlab_config(config, source=str(path / "config.json"))
    return config, spec, codebook_names(read_safetensors_dir(path), str(path))


def spec_from_zlab_config(config: dict[str, Any], source: str = "config.json",
                          family_fields: dict[str, Any] | None = None) -> DraftSpec:
    """Normalize a z-lab config.json the way `dflash.model.DFlashDraftModel` reads it. `family_fields`: a
    DSpark or XPress drafter's own settings (a speculators directory read through its z-lab shape)."""
    dflash = config.get("dflash_config") or {}

    def value(name, default=None):
        return dflash.get(name, config.get(name, default))

    try:
        layers = as_int("num_hidden_layers", config["num_hidden_layers"])
        hidden, heads = as_int("hidden_size", config["hidden_size"]), as_int("num_attention_heads", config["num_attention_heads"])
        num_target_layers = config.get("num_target_layers")
        ids = value("target_layer_ids")
        if ids is None:
            if num_target_layers is None:
                raise SpecError("target_layer_ids", "absent, and no num_target_layers to derive z-lab's default")
            ids = build_target_layer_ids(as_int("num_target_layers", num_target_layers), layers)
        if num_target_layers is None:
            raise SpecError("num_target_layers", "missing from config.json")
        mask_token_id = value("mask_token_id")
        if mask_token_id is None:
            raise SpecError("mask_token_id", "missing from dflash_config")
        use_sliding = bool(config.get("use_sliding_window", False))
        window = config.get("sliding_window") if use_sliding else None
        layer_types = config.get("layer_types") or ["full_attention"] * layers
        for name, listed in (("target_layer_ids", ids), ("layer_types", layer_types)):
            if not isinstance(listed, list):
                raise SpecError(name, f"must be a list, got {listed!r}")
        if "sliding_attention" in layer_types and window is None:
            # z-lab keeps such layers causal but unwindowed; an unreachable window says the same.
            window = as_int("max_position_embeddings", config.get("max_position_embeddings", QWEN3_DEFAULTS["max_position_embeddings"]))
        family = config_family(config)
        dflash2 = {name: as_int(name, value(name)) if value(name) is not None else None for name in DFLASH2_FIELDS}
        if family == "dflash2" and None in dflash2.values():
            raise SpecError(next(n for n, v in dflash2.items() if v is None), "missing from a DFlash2DraftModel config")
        return DraftSpec(
            **(dflash2 if family == "dflash2" else {}),
            **(family_fields or {}),
            sliding_window_non_causal=zlab_non_causal(config.get("is_causal"), layer_types),
            hidden_size=hidden,
            intermediate_size=as_int("intermediate_size", config["intermediate_size"]),
            num_attention_heads=heads,
            num_key_value_heads=as_int("num_key_value_heads", config.get("num_key_value_heads") or heads),
            head_dim=as_int("head_dim", config.get("head_dim") or hidden // heads),
            num_hidden_layers=layers,
            target_vocab_size=as_int("vocab_size", config["vocab_size"]),
            target_layer_ids=tuple(ids),
            num_target_layers=as_int("num_target_layers", num_target_layers),
            mask_token_id=as_int("mask_token_id", mask_token_id),
            block_size=as_int("block_size", value("block_size", BLOCK_SIZE_DEFAULTS["zlab"])),
            layer_types=tuple(layer_types),
            sliding_window=window,
            **rotary_settings(config),
            rms_norm_eps=as_float("rms_norm_eps", config.get("rms_norm_eps", QWEN3_DEFAULTS["rms_norm_eps"])),
            max_position_embeddings=as_int("max_position_embeddings", config.get("max_position_embeddings", QWEN3_DEFAULTS["max_position_embeddings"])),
            attention_bias=bool(config.get("attention_bias", QWEN3_DEFAULTS["attention_bias"])),
            hidden_act=str(config.get("hidden_act", QWEN3_DEFAULTS["hidden_act"])),
            input_embedding_scale=as_float("input_embedding_scale", value("input_embedding_scale",
                                                                          ZLAB_EXTRAS["input_embedding_scale"])),
            output_multiplier=as_float("output_multiplier", value("output_multiplier", ZLAB_EXTRAS["output_multiplier"])),
            final_logit_softcapping=value("final_logit_softcapping", ZLAB_EXTRAS["final_logit_softcapping"]),
            draft_vocab_size=draft_vocab_size(config),
            sample_from_anchor=as_bool("sample_from_anchor", dflash.get("sample_from_anchor", False)),
        )
    except KeyError as exc:
        raise CheckpointError(f"{source}: missing field {exc.args[0]!r}") from exc
    except SpecError as exc:
        raise CheckpointError(f"{source}: {exc}") from exc
    except (TypeError, ValueError, AttributeError) as exc:  # a kind no check above foresaw: still named
        raise CheckpointError(f"{source}: a field of the wrong kind ({plain_reason(str(exc))})") from exc


def draft_vocab_size(config: dict[str, Any]) -> int | None:
    """`draft_vocab_size` as vLLM reads a drafter's config (absent or null: the target's vocabulary); one written
    under `dflash_config` is read too (vLLM would not see it there: the serving check says so)."""
    value = config.get("draft_vocab_size", (config.get("dflash_config") or {}).get("draft_vocab_size"))
    return None if value is None else as_int("draft_vocab_size", value)


def zlab_non_causal(is_causal: Any, layer_types: list[str]) -> bool:
    """z-lab's `is_causal` (absent: sliding layers causal) as `sliding_window_non_causal`."""
    if is_causal is None:
        return False
    if not isinstance(is_causal, bool):
        raise SpecError("is_causal", f"{is_causal!r} is not true or false")
    if is_causal and "full_attention" in layer_types:
        raise SpecError("is_causal", "true makes z-lab's full-attention layers causal too, which no DFlash "
                                     "drafter does; refused rather than audited as something else")
    return not is_causal

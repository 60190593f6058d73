"""speculators' format: a directory whose config.json has `speculators_model_type: dflash` (or `dflash2`).

Its `aux_hidden_state_layer_ids` are z-lab ids + 1 and never name the verifier's final layer;
it stores the verifier's embeddings, head and final norm beside the draft body (kept apart
here), and reloads them from the verifier it records. Writing goes through speculators'
own `DFlashDraftModel.save_pretrained` and `load_verifier_weights`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from dflash_audit.formats.shape_inference import Contradiction, Provenance
from dflash_audit.formats.loaded import (
    LoadedCheckpoint,
    RawRecord,
    declared_provenance,
    rotary_provenance,
)
from foundation.errors import AuditError, CheckpointError
from foundation.inputs import read_json_object
from foundation.weights_dir import read_config, read_safetensors_dir
from impl.body_shapes import weights_dtype
from foundation.config_values import as_int
from impl.defaults import BLOCK_SIZE_DEFAULTS
from impl.families import SPECULATORS_TYPES, ZLAB_ARCHITECTURES, config_family
from impl.layers import names_final_layer, speculators_to_zlab, zlab_to_speculators
from foundation.param_names import verifier_owned_keys
from impl.spec import DFLASH2_FIELDS, FAMILY_FIELDS, SpecError, spec_misfit
from impl.vocab_mapping import mapping_problems, t2d_problems
from drafter_files.zlab_format import spec_from_zlab_config

def detect(config: dict[str, Any]) -> bool:
    return config.get("speculators_model_type") in SPECULATORS_TYPES


def class_default(config: dict[str, Any], name: str) -> Any:
    """A field's default in the config class of the directory's family (speculators' own, never restated)."""
    from reference_adapters.speculators_adapter import CONFIG_CLASSES

    return CONFIG_CLASSES[config_family(config)].model_fields[name].default


def non_causal(config: dict[str, Any]) -> bool:
    """`sliding_window_non_causal` as written, else the default of the directory's config class."""
    value = config.get("sliding_window_non_causal")
    return class_default(config, "sliding_window_non_causal") if value is None else bool(value)


def family_fields(config: dict[str, Any]) -> dict[str, Any]:
    """A DSpark or XPress directory's head settings, as written or its config class's defaults."""
    family = config_family(config)
    if family not in ("dspark", "xpress"):
        return {}
    return {name: config.get(name, class_default(config, name)) for name in FAMILY_FIELDS[family]}


def verifier_layer_count(config: dict[str, Any], target_dir: str | Path | None, source: str) -> int:
    """Decoder layers of a speculators drafter's verifier: from `target_dir`, else its recorded local verifier."""
    recorded = ((config.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path")
    for candidate in (target_dir, recorded):
        if candidate and (Path(candidate) / "config.json").is_file():
            verifier_config = Path(candidate) / "config.json"
            verifier = read_json_object(verifier_config, "config.json")
            verifier = verifier.get("text_config", verifier)  # multimodal verifiers nest it
            if isinstance(verifier, dict) and "num_hidden_layers" in verifier:
                try:
                    return as_int("num_hidden_layers", verifier["num_hidden_layers"])
                except SpecError as exc:
                    raise CheckpointError(f"{verifier_config}: {exc}") from None
    if "num_target_layers" in config:
        try:
            return as_int("num_target_layers", config["num_target_layers"])
        except SpecError as exc:
            raise CheckpointError(f"{source}: {exc}") from None
    raise CheckpointError(f"{source}: cannot tell the verifier's layer count: its verifier {recorded!r} is not a "
                          "local directory; pass the target directory (--target)")


def rotary_view(config: dict[str, Any]) -> dict[str, Any]:
    """The layer config speculators builds its rotary from, plus an `is_neox_style` stated beside it."""
    layer_config = dict(config.get("transformer_layer_config") or {})
    if "is_neox_style" in config:
        layer_config.setdefault("is_neox_style", config["is_neox_style"])
    return layer_config


def zlab_shaped_config(config: dict[str, Any], num_target_layers: int, source: str) -> dict[str, Any]:
    """A speculators config.json rewritten as the z-lab config of the same drafter (ids shifted back)."""
    from transformers import AutoConfig

    if not config.get("transformer_layer_config"):
        raise CheckpointError(f"{source}: no transformer_layer_config")
    layer_config = rotary_view(config)
    # Fill Qwen3 defaults for the fields its diff-dict left out, as speculators does on load.
    full = AutoConfig.for_model(**{"model_type": "qwen3", **layer_config}).to_dict()
    aux = config.get("aux_hidden_state_layer_ids")
    if not aux:
        raise CheckpointError(f"{source}: no aux_hidden_state_layer_ids")
    try:
        ids = speculators_to_zlab(aux)
    except ValueError as exc:
        raise CheckpointError(f"{source}: aux_hidden_state_layer_ids: {exc}") from exc
    full.update(num_target_layers=num_target_layers, dflash_config={
        "target_layer_ids": ids, "mask_token_id": config.get("mask_token_id"),
        "block_size": config.get("block_size", BLOCK_SIZE_DEFAULTS["speculators"]),
        "sample_from_anchor": config.get("sample_from_anchor", class_default(config, "sample_from_anchor"))})
    if config_family(config) == "dflash2":
        from speculators.models.dflash2 import DFlash2SpeculatorConfig

        full["architectures"] = [ZLAB_ARCHITECTURES["dflash2"]]
        defaults = DFlash2SpeculatorConfig.model_fields
        full["dflash_config"].update({name: config.get(name, defaults[name].default) for name in DFLASH2_FIELDS})
    if non_causal(config):
        full["is_causal"] = False  # z-lab's way of saying it
    full["draft_vocab_size"] = config.get("draft_vocab_size")  # equal to the verifier's: no reduced vocabulary
    return full


def load(path: Path, target_dir: str | Path | None = None) -> LoadedCheckpoint:
    source = str(path / "config.json")
    config = read_config(path)
    num_target_layers = verifier_layer_count(config, target_dir, source)
    spec = spec_from_zlab_config(zlab_shaped_config(config, num_target_layers, source), source=source,
                                 family_fields=family_fields(config))
    tensors = read_safetensors_dir(path)
    verifier = {k: tensors.pop(k) for k in verifier_owned_keys(spec.reduced_vocab) if k in tensors}
    contradictions = mapping_contradictions(spec, tensors.get("d2t"), verifier.get("t2d"))
    raw = RawRecord(config=config, layer_ids=list(config["aux_hidden_state_layer_ids"]),
                    layer_id_convention="speculators",
                    draft_vocab_size=config.get("draft_vocab_size", spec.target_vocab_size),
                    verifier=((config.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path"))
    present = set(config) | set(config.get("transformer_layer_config") or {}) | {"target_layer_ids",
                                                                                  "num_target_layers"}
    provenance = declared_provenance(spec, "config.json", present | {"sliding_window"},
                                     "not in config.json; Qwen3's default")
    rotary_provenance(provenance, rotary_view(config), "config.json transformer_layer_config",
                      "transformers' Qwen3Config default, which speculators builds its layers and rotary from")
    provenance["target_layer_ids"] = Provenance("declared", "config.json aux_hidden_state_layer_ids (id - 1)")
    provenance["num_target_layers"] = Provenance("inferred", "the verifier's config.json num_hidden_layers")
    if "block_size" not in config:
        provenance["block_size"] = Provenance("default", "not in config.json; speculators' default "
                                                         f"{BLOCK_SIZE_DEFAULTS['speculators']}")
    for name in ("sliding_window_non_causal", "sample_from_anchor", *FAMILY_FIELDS[spec.family]):
        if name not in config:
            provenance[name] = Provenance("default", f"not in config.json; speculators' "
                                                     f"{config['speculators_model_type']} default")
    if "draft_vocab_size" not in config:
        provenance["draft_vocab_size"] = Provenance("default", "not in config.json; read as the verifier's "
                                                               "vocabulary (no d2t/t2d mapping)")
    return LoadedCheckpoint(spec=spec, state_dict=tensors, path=str(path), format="speculators", raw=raw,
                            verifier_tensors=verifier, provenance=provenance, contradictions=contradictions)


def mapping_contradictions(spec, d2t: torch.Tensor | None, t2d: torch.Tensor | None) -> list[Contradiction]:
    """speculators stores the mapping twice (d2t offsets, t2d mask): where the two disagree."""
    if not spec.reduced_vocab or d2t is None or t2d is None or mapping_problems(d2t, spec.draft_vocab_size,
                                                                                 spec.target_vocab_size):
        return []  # a missing or malformed d2t is the audit's draft_vocab finding, not a contradiction
    return [Contradiction("draft_vocab_size", f"draft_vocab_size: {problem}")
            for problem in t2d_problems(t2d, d2t, spec.target_vocab_size)]


def verifier_for(loaded: LoadedCheckpoint, target: str | Path | None) -> Path:
    """The verifier directory a speculators destination records and reads its tensors from."""
    recorded = loaded.raw.verifier
    candidate = target or (recorded if loaded.format == "speculators" else None)
    if candidate is None:
        raise AuditError("converting to speculators needs --target DIR: speculators stores the target's "
                         "embeddings, LM head and final norm, and records the target as its verifier")
    path = Path(candidate)
    if not (path / "config.json").is_file():
        raise AuditError(f"{path}: not a Hugging Face model directory (no config.json) to use as the target")
    config = read_json_object(path / "config.json", "config.json")
    config = config.get("text_config", config) if isinstance(config.get("text_config"), dict) else config
    spec = loaded.spec
    why = spec_misfit(spec, config.get("hidden_size"), config.get("num_hidden_layers"))
    if why is not None:
        raise AuditError(f"{path}: the drafter cannot run against this target: {why}")
    check_verifier_weights(path)
    return path.resolve()


def check_verifier_weights(path: str | Path) -> None:
    """Before anything is loaded: the target folder holds what speculators' load_verifier_weights reads."""
    from reference_adapters.speculators_verifier import missing_verifier_weights

    missing = missing_verifier_weights(path)
    if missing:
        raise AuditError(f"{path}: speculators reloads the target's embeddings, head and final norm from this "
                         f"folder, but {'; '.join(missing)}")


def fc_without_final_layer(loaded: LoadedCheckpoint) -> tuple[list[int], dict[str, torch.Tensor]]:
    """speculators' aux ids and a body whose fc no longer reads the final layer (speculators drops it)."""
    spec = loaded.spec
    keep = [k for k, i in enumerate(spec.target_layer_ids) if not names_final_layer(i, spec.num_target_layers)]
    if not keep:
        raise AuditError(f"{loaded.path}: every target layer is the final one; speculators would keep none")
    state = dict(loaded.state_dict)
    if len(keep) < len(spec.target_layer_ids):
        h = spec.hidden_size
        columns = torch.cat([torch.arange(k * h, (k + 1) * h) for k in keep])
        state["fc.weight"] = state["fc.weight"][:, columns].contiguous()
    return zlab_to_speculators(list(spec.target_layer_ids), spec.num_target_layers), state


def save(loaded: LoadedCheckpoint, destination: Path, target: str | Path | None) -> None:
    from reference_adapters import speculators_adapter as adapter

    verifier = verifier_for(loaded, target)
    aux_ids, body = fc_without_final_layer(loaded)
    # The layout is the drafter's (its spec): speculators records it as `sample_from_anchor` and as the
    # proposal's `speculative_tokens`.
    config = adapter.speculators_config(loaded.spec, verifier, aux_layer_ids=aux_ids)
    model = adapter.MODEL_CLASSES[loaded.spec.family](config)
    try:
        adapter.load_body(model, body, loaded.path)
    except (CheckpointError, ValueError) as exc:  # ValueError: speculators' load_vocab_mappings refusing the map
        raise AuditError(str(exc) if isinstance(exc, CheckpointError) else f"{loaded.path}: {exc}") from exc
    model.load_verifier_weights()  # speculators' own loader, from the verifier directory
    model.to(dtype=weights_dtype(body))  # moves floating tensors only: d2t/t2d keep theirs
    adapter.save_speculators_model(model, destination)

"""Conversion between the three drafter formats: ours (`*.pt`), zlab and speculators (directories).

The draft body is copied tensor for tensor; only the layer-id convention changes
(z-lab id i <-> speculators aux id i + 1). A speculators directory is written by
speculators itself (`DFlashDraftModel.save_pretrained`), with its verifier-owned tensors
read from the target directory by its own `load_verifier_weights`, exactly as its
`DFlashConverter` does. A conversion that would change what the drafter computes is
refused unless `allow_lossy`; settings the destination merely cannot record (the
training recipe) are reported as notes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dflash_audit.errors import AuditError
from dflash_audit.formats import FORMATS, LoadedCheckpoint, LoadOptions, load_any, require_spec
from impl.checkpoint import build_drafter, save_checkpoint, save_zlab_dir
from impl.layers import zlab_to_speculators
from impl.spec import Recipe


@dataclass
class ConversionResult:
    source: str
    source_format: str
    destination: str
    format: str
    notes: list[str] = field(default_factory=list)


# -- what a destination cannot hold ---------------------------------------------------------
def lossy_changes(loaded: LoadedCheckpoint, fmt: str) -> list[str]:
    """Ways the converted drafter would compute something else than the source."""
    spec, raw, changes = loaded.spec, loaded.raw, []
    if fmt == "speculators":
        final = [i for i in spec.target_layer_ids if i + 1 == spec.num_target_layers]
        if final:
            changes.append(f"target layer {final[0]} is the verifier's final layer, which speculators does not feed "
                           "to fc (its fc columns would be dropped)")
        extras = {"input_embedding_scale": 1.0, "output_multiplier": 1.0, "final_logit_softcapping": None}
        changed = [name for name, default in extras.items() if getattr(spec, name) != default]
        if changed:
            changes.append(f"speculators has no {', '.join(changed)} (z-lab dflash_config)")
    else:
        if raw.get("sliding_window_non_causal") and "sliding_attention" in spec.layer_types:
            changes.append("sliding layers see their whole block (sliding_window_non_causal); "
                           f"{fmt} keeps them causal")
        if raw.get("draft_vocab_size", spec.vocab_size) != spec.vocab_size:
            changes.append(f"reduced draft vocabulary ({raw['draft_vocab_size']} of {spec.vocab_size} tokens); "
                           f"{fmt} drafts over the target's full head")
    return changes


def recipe_notes(loaded: LoadedCheckpoint, fmt: str) -> list[str]:
    notes = []
    if loaded.recipe_unknown:
        notes.append(f"recipe fields never declared by the source stay unknown: {', '.join(loaded.recipe_unknown)}")
    if loaded.recipe is not None and fmt != "ours":
        notes.append(f"the training recipe (gamma {loaded.recipe.gamma}, {loaded.recipe.loss_fn}, ...) is not "
                     f"recorded by the {fmt} format; the weights are unchanged")
    if loaded.raw.get("sample_from_anchor") and fmt != "speculators":
        notes.append(f"trained with sample_from_anchor (DSpark alignment), which the {fmt} format does not record")
    if loaded.verifier_tensors and fmt != "speculators":
        notes.append(f"verifier-owned tensors {sorted(loaded.verifier_tensors)} dropped: {fmt} borrows them from "
                     "the target")
    return notes


# -- writers ---------------------------------------------------------------------------------
def _dtype_of(state_dict: dict[str, torch.Tensor]) -> torch.dtype:
    return next(iter(state_dict.values())).dtype


def write_ours(loaded: LoadedCheckpoint, destination: Path) -> None:
    model = build_drafter(loaded.spec, loaded.state_dict, dtype=_dtype_of(loaded.state_dict), source=loaded.path)
    recipe = loaded.recipe if loaded.recipe is not None or not loaded.recipe_unknown else Recipe()
    save_checkpoint(destination, model, recipe=recipe, step=loaded.step, recipe_unknown=loaded.recipe_unknown)


def write_zlab(loaded: LoadedCheckpoint, destination: Path) -> None:
    build_drafter(loaded.spec, loaded.state_dict, source=loaded.path)  # one-line error on a bad body
    save_zlab_dir(destination, loaded.spec, loaded.state_dict)


def verifier_for(loaded: LoadedCheckpoint, target: str | Path | None) -> Path:
    """The verifier directory a speculators destination records and reads its tensors from."""
    recorded = loaded.raw.get("verifier")
    candidate = target or (recorded if loaded.format == "speculators" else None)
    if candidate is None:
        raise AuditError("converting to speculators needs --target DIR: speculators stores the target's "
                         "embeddings, LM head and final norm, and records the target as its verifier")
    path = Path(candidate)
    if not (path / "config.json").is_file():
        raise AuditError(f"{path}: not a Hugging Face model directory (no config.json) to use as the target")
    config = json.loads((path / "config.json").read_text())
    config = config.get("text_config", config)
    spec = loaded.spec
    if config.get("hidden_size") != spec.hidden_size:
        raise AuditError(f"{path}: target hidden_size {config.get('hidden_size')} != drafter hidden_size "
                         f"{spec.hidden_size}")
    if config.get("num_hidden_layers") != spec.num_target_layers:
        raise AuditError(f"{path}: target has {config.get('num_hidden_layers')} decoder layers, the drafter was "
                         f"built for {spec.num_target_layers}")
    return path.resolve()


def fc_without_final_layer(loaded: LoadedCheckpoint) -> tuple[list[int], dict[str, torch.Tensor]]:
    """speculators' aux ids and a body whose fc no longer reads the final layer (speculators drops it)."""
    spec = loaded.spec
    keep = [k for k, i in enumerate(spec.target_layer_ids) if i + 1 != spec.num_target_layers]
    if not keep:
        raise AuditError(f"{loaded.path}: every target layer is the final one; speculators would keep none")
    state = dict(loaded.state_dict)
    if len(keep) < len(spec.target_layer_ids):
        h = spec.hidden_size
        columns = torch.cat([torch.arange(k * h, (k + 1) * h) for k in keep])
        state["fc.weight"] = state["fc.weight"][:, columns].contiguous()
    return zlab_to_speculators(list(spec.target_layer_ids), spec.num_target_layers), state


def write_speculators(loaded: LoadedCheckpoint, destination: Path, target: str | Path | None) -> None:
    from reference_adapters import speculators_adapter as adapter

    verifier = verifier_for(loaded, target)
    aux_ids, body = fc_without_final_layer(loaded)
    sample_from_anchor = loaded.raw.get("sample_from_anchor",
                                        bool(loaded.recipe and loaded.recipe.sample_from_anchor))
    config = adapter.speculators_config(loaded.spec, verifier, aux_layer_ids=aux_ids,
                                        sample_from_anchor=sample_from_anchor,
                                        sliding_window_non_causal=loaded.raw.get("sliding_window_non_causal", False))
    model = adapter.DFlashDraftModel(config)
    missing, unexpected = model.load_state_dict(body, strict=False)
    missing = [k for k in missing if k not in adapter.VERIFIER_OWNED_KEYS]
    if missing or unexpected:
        raise AuditError(f"{loaded.path}: the draft body does not fit speculators' DFlashDraftModel "
                         f"(missing {missing[:3]}, unexpected {unexpected[:3]})")
    model.load_verifier_weights()  # speculators' own loader, from the verifier directory
    model.to(dtype=_dtype_of(body))
    adapter.save_speculators_model(model, destination)


# -- entry point ------------------------------------------------------------------------------
def convert(source: str | Path, destination: str | Path, fmt: str, target: str | Path | None = None,
            allow_lossy: bool = False, options: LoadOptions | None = None) -> ConversionResult:
    if fmt not in FORMATS:
        raise AuditError(f"unknown format {fmt!r}; expected one of {list(FORMATS)}")
    source, destination = Path(source), Path(destination)
    if source.resolve() == destination.resolve():
        raise AuditError(f"{destination}: the destination is the source")
    if fmt == "ours" and (destination.is_dir() or destination.suffix != ".pt"):
        raise AuditError(f"{destination}: the ours format is a single *.pt file")
    if fmt != "ours" and destination.is_file():
        raise AuditError(f"{destination}: a file; the {fmt} format is a directory")
    loaded = load_any(source, target_dir=target, options=options or LoadOptions(flag_prefix=""))
    require_spec(loaded, "convert")
    if loaded.contradictions:
        raise AuditError(f"{source}: contradicts itself ({loaded.contradictions[0]}); settle it with --spec "
                         "before converting")
    unmapped = loaded.foreign.get("key_map", {}).get("unmapped", [])
    if unmapped:
        raise AuditError(f"{source}: {len(unmapped)} tensor(s) map to no DFlash parameter (first: {unmapped[0]!r}); "
                         "a conversion would drop them: map them with --key-map or remove them")
    changes = lossy_changes(loaded, fmt)
    if changes and not allow_lossy:
        raise AuditError(f"{source} -> {fmt} would change the drafter: {'; '.join(changes)}; "
                         "pass --allow-lossy to convert anyway")
    if fmt == "ours":
        write_ours(loaded, destination)
    elif fmt == "zlab":
        write_zlab(loaded, destination)
    else:
        write_speculators(loaded, destination, target)
    notes = [f"lossy: {change}" for change in changes] + recipe_notes(loaded, fmt)
    return ConversionResult(source=str(source), source_format=loaded.format, destination=str(destination),
                            format=fmt, notes=notes)

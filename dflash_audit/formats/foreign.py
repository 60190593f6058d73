"""Checkpoints this tool did not write: a team's own `ckpt.pt`, a bare `*.safetensors`, a
`save_pretrained` folder or sharded weights, with their own names and training args.

Weights are read safely (`safe_pickle`, safetensors), the drafter's entry picked
(`payload`), names mapped to the canonical scheme (`key_map`), and the spec and recipe
inferred with provenance (`inference`) from shapes, declarations in the file and in the
configs beside it, the target's config and the command line.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from dflash_audit.formats import layouts
from dflash_audit.formats.shape_inference import Inference, infer, parse_cli_spec, shapes_of
from dflash_audit.formats.key_map import (
    KeyMapError,
    map_names,
    propose_key_map,
    read_key_map,
)
from dflash_audit.formats.loaded import LoadedCheckpoint, LoadOptions, RawRecord
from dflash_audit.formats.payload import Payload
from dflash_audit.formats.safe_yaml import (
    MAX_SETTINGS_BYTES,
    describe,
    read_settings,
    set_aside_note,
    settings_mapping,
)
from dflash_audit.formats.setting_names import DeclarationError
from dflash_audit.formats.weight_file import read_weight_file
from foundation.errors import CheckpointError
from foundation.weights_dir import index_shards
from foundation.param_names import verifier_owned_keys
from impl.spec import SpecError

PICKLE_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt")
WEIGHT_SUFFIXES = PICKLE_SUFFIXES + (".safetensors",)
# Declaration files read beside a checkpoint (any *.yaml / *.yml in a checkpoint folder too).
CONFIG_FILES = ("config.json", "args.json", "training_config.json", "train_config.json", "hparams.json")
YAML_FILES = ("config.yaml", "hparams.yaml", "args.yaml", "training_config.yaml", "train_config.yaml")
INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")


class UnknownScheme(CheckpointError):
    """Names that match no known scheme; carries the proposed --key-map text."""

    def __init__(self, message: str, proposal: str):
        super().__init__(message)
        self.proposal = proposal


@dataclass
class ForeignRead:
    tensors: dict[str, torch.Tensor]  # canonical names
    payload: Payload
    mapping: Any  # key_map.NameMapping
    inference: Inference
    files: list[str]
    layout: str | None = None  # the framework layout read (layouts.detect), None for plain weight files
    placeholders: list[str] = field(default_factory=list)  # 0-element tensors left out of the audit
    set_aside: dict[str, str] = field(default_factory=dict)  # settings files beside it too large to read, and why


# -- reading -----------------------------------------------------------------------------------
def is_weight_file(path: Path) -> bool:
    return path.is_file() and path.name.endswith(WEIGHT_SUFFIXES)


def weight_files_of(folder: Path) -> list[Path]:
    """The weight files of a checkpoint folder: an index's shards, else its one weight file."""
    for index_name in INDEXES:
        index = folder / index_name
        if index.is_file():
            return index_shards(index)
    found = sorted(p for p in folder.iterdir() if is_weight_file(p) and not layouts.accelerate.role_of_file(p.name))
    preferred = [p for p in found if p.name in ("model.safetensors", "pytorch_model.bin")]
    if preferred:
        return preferred[:1]
    if len(found) == 1:
        return found
    if not found:
        names = sorted(p.name for p in folder.iterdir())[:8]
        raise CheckpointError(f"{folder}: no weights (*.safetensors, *.pt, *.pth, *.bin, *.ckpt) in the directory "
                              f"(found {names or 'nothing'})")
    raise CheckpointError(f"{folder}: several weight files ({', '.join(p.name for p in found[:6])}) and no index; "
                          "pass the one to audit")


def read_payloads(files: list[Path], entry: str | None, entry_flag: str) -> Payload:
    merged: Payload | None = None
    for path in files:
        part = read_weight_file(path, entry, entry_flag)
        if merged is None:
            merged = part
            continue
        clash = sorted(set(merged.tensors) & set(part.tensors))
        if clash:
            raise CheckpointError(f"{path}: tensor {clash[0]!r} also stands in another shard")
        merged.tensors.update(part.tensors)
    return merged


def declaration_files(path: Path) -> list[Path]:
    """Configs beside a weight file (or inside a checkpoint folder) that may declare settings."""
    folder = path if path.is_dir() else path.parent
    names = list(CONFIG_FILES) + list(YAML_FILES)
    if path.is_file():
        names += [f"{path.stem}.json", f"{path.stem}.yaml", f"{path.stem}.yml"]
    for name in dict.fromkeys(names):  # a FIFO config would block the read, or be skipped as absent
        if (folder / name).exists() and not (folder / name).is_file():
            raise CheckpointError(f"{folder / name}: not a regular file (a directory, FIFO or device); a config "
                                  "beside a checkpoint must be a file")
    found = [folder / n for n in dict.fromkeys(names) if (folder / n).is_file()]
    if path.is_dir():
        found += sorted(p for p in folder.iterdir() if p.suffix in (".yaml", ".yml") and p not in found)
    return found


def read_declaration_file(path: Path) -> dict[str, Any]:
    if set_aside_note(path) is not None:  # before reading it (read_foreign sets such a file aside)
        raise CheckpointError(f"{path}: {path.stat().st_size:,} bytes, more than a settings file's "
                              f"{MAX_SETTINGS_BYTES >> 20} MiB; refusing to read it")
    kind = "json" if path.suffix == ".json" else path.suffix.lstrip(".")
    return settings_mapping(read_settings(path.read_bytes(), str(path), kind), str(path))


def read_target_config(target_dir: str | Path | None) -> dict[str, Any] | None:
    if target_dir is None:
        return None
    config = Path(target_dir) / "config.json"
    if not config.is_file():
        return None
    data = read_declaration_file(config)
    return data.get("text_config", data) if isinstance(data.get("text_config"), dict) else data


# -- the whole load ----------------------------------------------------------------------------------
def read_foreign(path: Path, options: LoadOptions, target_dir: str | Path | None = None) -> ForeignRead:
    opened = layouts.open_layout(path, options.entry, options.flag("entry"))
    if opened is not None:
        files, payload = opened.files, opened.payload
    else:
        files = weight_files_of(path) if path.is_dir() else [path]
        payload = read_payloads(files, options.entry, options.flag("entry"))
    if not payload.tensors:
        raise CheckpointError(f"{path}: holds no tensors")
    placeholders = drop_placeholders(path, payload)
    payload.ignored.update(layouts.accelerate.training_state_files(path if path.is_dir() else path.parent))
    rules = None
    if options.key_map is not None:
        try:
            rules = read_key_map(Path(options.key_map))
        except KeyMapError as exc:
            raise CheckpointError(str(exc)) from exc
    try:
        mapping = map_names(list(payload.tensors), rules, str(options.key_map))
    except KeyMapError as exc:
        raise CheckpointError(f"{path}: {exc}") from exc
    if mapping is None:
        proposal = propose_key_map(shapes_of(payload.tensors))
        example = next(iter(payload.tensors))
        raise UnknownScheme(
            f"{path}: parameter names match no known scheme (e.g. {example!r}, {len(payload.tensors)} tensors); "
            "a proposed map is printed above: check it, save it and pass it with --key-map FILE", proposal)
    tensors = {mapping.renamed[raw]: tensor for raw, tensor in payload.tensors.items()}
    label = path.name
    sources = [(f"{label}: {entry}" if entry else f"{label}:", data) for entry, data in payload.declarations]
    sources += opened.declarations if opened is not None else []
    set_aside: dict[str, str] = {}  # settings files too large to read, by label
    for config in declaration_files(path):
        if config.resolve() in {f.resolve() for f in files}:
            continue
        if (note := set_aside_note(config)) is not None:
            set_aside[config.name] = note
            continue
        sources.append((f"{config.name}:", read_declaration_file(config)))
    for config in layouts.nested_config.run_config_files(path):
        label = layouts.nested_config.label_of(config, path)
        if (note := set_aside_note(config)) is not None:
            set_aside[label.rstrip(":")] = note
            continue
        sources.append((label, layouts.nested_config.read_run_config(config)))
    try:
        cli = parse_cli_spec(options.spec, options.flag("spec"))
        inference = infer(shapes_of(tensors), sources, read_target_config(target_dir),
                          f"--target {target_dir}/config.json", cli, options.flag("spec"))
    except DeclarationError as exc:
        raise CheckpointError(str(exc)) from exc
    return ForeignRead(tensors=tensors, payload=payload, mapping=mapping, inference=inference,
                       files=[str(f) for f in files], layout=opened.layout if opened is not None else None,
                       placeholders=placeholders, set_aside=set_aside)


def drop_placeholders(path: Path, payload: Payload) -> list[str]:
    """0-element tensors (a partitioned checkpoint's stand-ins) are never audited as weights; a file of
    nothing else has no drafter to audit."""
    empty = [name for name, tensor in payload.tensors.items() if tensor.numel() == 0]
    if empty and len(empty) == len(payload.tensors):
        raise CheckpointError(f"{path}: all {len(empty)} tensors are 0-element placeholders (e.g. {empty[0]!r}): "
                              "the weights were partitioned elsewhere (DeepSpeed ZeRO-3, FSDP); pass the checkpoint "
                              "that holds them, or consolidate it (DeepSpeed: python zero_to_fp32.py <checkpoint_dir> "
                              "<output_dir>)")
    for name in empty:
        del payload.tensors[name]
    return empty


def load_foreign(path: Path, options: LoadOptions, target_dir: str | Path | None) -> LoadedCheckpoint:
    try:
        read = read_foreign(path, options, target_dir)
    except (ArithmeticError, LookupError, TypeError, AttributeError, RuntimeError) as exc:
        # A layout nothing here foresaw: one line about the checkpoint, never an internal exception's name.
        what = describe(exc, "an unforeseen layout")
        raise CheckpointError(f"{path}: cannot be read as a drafter checkpoint ({what}); "
                              "rerun with --debug for the details") from exc
    inference = read.inference
    try:
        spec = inference.spec(str(path))
        recipe = inference.recipe()
    except (DeclarationError, SpecError) as exc:
        raise CheckpointError(f"{path}: {exc}" if str(path) not in str(exc) else str(exc)) from exc
    known = dict(inference.values)
    owned_keys = verifier_owned_keys(known.get("draft_vocab_size") is not None)
    body = {k: v for k, v in read.tensors.items() if k not in owned_keys}
    owned = {k: v for k, v in read.tensors.items() if k in owned_keys}
    if "target_layer_ids" in known:
        known["target_layer_ids"] = list(known["target_layer_ids"])
    foreign = {"files": read.files, "entry": read.payload.entry, "ignored_entries": read.payload.ignored,
               "key_map": {"scheme": read.mapping.scheme, "renamed": read.mapping.renamed,
                           "unmapped": read.mapping.unmapped},
               "unrecognized_keys": inference.unrecognized, "fc_layer_count": inference.fc_layer_count,
               "layout": read.layout, "placeholders": read.placeholders, "set_aside": read.set_aside}
    ids = known.get("target_layer_ids")
    return LoadedCheckpoint(spec=spec, state_dict=body, recipe=recipe, path=str(path), format="foreign",
                            raw=RawRecord(layer_ids=ids),
                            verifier_tensors=owned, provenance=inference.provenance, known_spec=known,
                            recipe_unknown=inference.recipe_unknown, contradictions=inference.contradictions,
                            foreign=foreign)

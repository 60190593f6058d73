"""What every format loader returns: a normalized checkpoint, its raw on-disk record and the
provenance of each spec field; and the rules shared by all formats (`--ours-spec` on top of
what a file says, and the one-line error when a verb needs a spec that is incomplete)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from dflash_audit.formats.shape_inference import Contradiction, Provenance, parse_cli_spec
from dflash_audit.formats.setting_names import DeclarationError
from foundation.errors import AuditError
from drafter_files.checkpoint import Checkpoint
from impl.recipe import Recipe
from impl.spec import CONFIG_KEYS, SPEC_FIELDS, DraftSpec, SpecError


@dataclass
class LoadOptions:
    """How the user told us to read a checkpoint: the flags `--ours-entry`, `--key-map`, `--ours-spec`."""

    entry: str | None = None
    key_map: Path | None = None
    spec: list[str] = field(default_factory=list)
    flag_prefix: str = "--ours"  # names the flags in messages: --ours-entry, --ref-spec, --entry, ...

    def flag(self, what: str) -> str:
        return f"{self.flag_prefix}-{what}" if self.flag_prefix else f"--{what}"


@dataclass
class RawRecord:
    """What a report shows of a side as stored, and the settings a DraftSpec cannot hold."""

    config: dict[str, Any] | None = None  # config.json as written (None: the format has none)
    layer_ids: list[int] | None = None  # target layer ids as written, in `layer_id_convention`
    layer_id_convention: str = "zlab"  # "zlab" (hs[id + 1]) or "speculators" (hs[id])
    layer_ids_defaulted: bool = False  # the file gave none; z-lab's default was used
    draft_vocab_size: int | None = None  # speculators' reduced draft vocabulary
    verifier: str | None = None  # the verifier a speculators drafter records


@dataclass
class LoadedCheckpoint(Checkpoint):
    path: str = ""
    format: str = ""
    raw: RawRecord = field(default_factory=RawRecord)
    verifier_tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    provenance: dict[str, Provenance] = field(default_factory=dict)  # spec field / "recipe.<field>" -> source
    known_spec: dict[str, Any] = field(default_factory=dict)  # every known spec field (all of them when spec is set)
    recipe_unknown: list[str] = field(default_factory=list)  # recipe fields nobody declared
    contradictions: list[Contradiction] = field(default_factory=list)  # the checkpoint disagreeing with itself
    foreign: dict[str, Any] = field(default_factory=dict)  # entry used, ignored entries, key map, unrecognized keys
    gguf: dict[str, Any] = field(default_factory=dict)  # a GGUF file's version, converter, each tensor's type


def require_spec(loaded: LoadedCheckpoint, what: str) -> DraftSpec:
    """The complete spec, or a one-line error naming every missing field and the flag that gives it."""
    if loaded.spec is not None:
        return loaded.spec
    details = {name: p.detail for name, p in loaded.provenance.items()}
    raise incomplete_spec(loaded.path, loaded.known_spec, details, what)


def incomplete_spec(path: str, known: dict[str, Any], details: dict[str, str], what: str) -> AuditError:
    missing = [name for name in SPEC_FIELDS if name not in known]
    hints = "; ".join(f"{name}: {details.get(name, 'unknown')}" for name in missing)
    return AuditError(f"{path}: {what} needs the whole spec, and {len(missing)} field(s) are unknown "
                      f"({', '.join(missing)}). {hints}")


def declared_provenance(spec: DraftSpec, detail: str, present: set[str] | None = None,
                        defaulted_detail: str = "not in the config; the format's default") -> dict[str, Provenance]:
    """Every field declared by the file, except those absent from it (`present` given) which took a default."""
    return {name: Provenance("declared", detail) if present is None or name in present
            or CONFIG_KEYS.get(name) in present
            else Provenance("default", defaulted_detail) for name in SPEC_FIELDS}


# Whose default a rotary setting a config leaves out takes (rope_theta's is the format's: see `rotary_provenance`).
ROTARY_DEFAULT_DETAILS = {
    "rope_scaling": "no rope_type: transformers' default rope (unscaled)",
    "partial_rotary_factor": "every head dim rotated (transformers' default 1.0)",
    "rope_style": "no is_neox_style: neox (rotate_half), the engines' default and the only style the references run",
}


def rotary_provenance(provenance: dict[str, Provenance], config: dict[str, Any], where: str,
                      theta_default: str) -> None:
    """The rotary fields of `provenance`: declared where `config` states them, else whose default each took."""
    from impl.spec import ROTARY_FIELDS
    from impl.rotary_config import declared_rotary

    declared = declared_rotary(config)
    details = {**ROTARY_DEFAULT_DETAILS, "rope_theta": theta_default}
    for name in ROTARY_FIELDS:
        provenance[name] = (Provenance("declared", where) if name in declared
                            else Provenance("default", f"not in {where}; {details[name]}"))


def apply_cli_spec(loaded: LoadedCheckpoint, options: LoadOptions) -> LoadedCheckpoint:
    """`--ours-spec KEY=VALUE` on a drafter of a known format: the value replaces what the file says."""
    if loaded.spec is not None:
        loaded.known_spec = loaded.spec.to_dict()
    if not options.spec:
        return loaded
    try:
        cli = parse_cli_spec(options.spec, options.flag("spec"))
    except DeclarationError as exc:
        raise AuditError(str(exc)) from exc
    spec_fields = set(SPEC_FIELDS)
    spec_changes = {k: (tuple(v) if isinstance(v, list) else v) for k, (v, _) in cli.items() if k in spec_fields}
    recipe_changes = {k: v for k, (v, _) in cli.items() if k not in spec_fields}
    try:
        loaded.spec = loaded.spec.replace(**spec_changes)
        if recipe_changes:
            loaded.recipe = (loaded.recipe or Recipe()).replace(**recipe_changes)
    except SpecError as exc:
        raise AuditError(f"{loaded.path}: {options.flag('spec')}: {exc}") from exc
    for name, (_, detail) in cli.items():
        loaded.provenance[name if name in spec_fields else f"recipe.{name}"] = Provenance("cli", detail)
    loaded.known_spec = loaded.spec.to_dict()
    return loaded



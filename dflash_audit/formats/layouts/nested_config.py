"""Configs a training run writes around its checkpoints rather than beside them.

- Hydra: `.hydra/config.yaml` (the composed config) and `.hydra/overrides.yaml` (the command-line
  overrides, `group.key=value` strings) in the run folder, which is the checkpoint's folder or one
  or two levels above it (`outputs/<date>/<time>/checkpoints/last.pt`);
- Lightning: `hparams.yaml` in the version folder above `checkpoints/`
  (`lightning_logs/version_0/checkpoints/epoch=3.ckpt`).

Nested keys are recognized by their last component (`model.target_layer_ids`, `loss.gamma`); the
label of each source is the file's path relative to the checkpoint's folder, so provenance reads
`../.hydra/config.yaml: model.target_layer_ids`. Simple interpolations (`${model.block_size}`) are
resolved within the file; others (resolvers such as `${oc.env:X}`) are left out, unread.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from dflash_audit.formats.safe_yaml import YamlLimit, expansion_limit, load_yaml, read_settings, settings_mapping
from foundation.errors import CheckpointError

LEVELS_UP = 2
HYDRA_FILES = ("config.yaml", "overrides.yaml")
REFERENCE = re.compile(r"^\$\{([A-Za-z_][\w.]*)\}$")


def run_config_files(path: Path) -> list[Path]:
    """Hydra and Lightning run configs around `path`, nearest folder first."""
    start = path if path.is_dir() else path.parent
    found: list[Path] = []
    folder = start
    for level in range(LEVELS_UP + 1):
        found += [folder / ".hydra" / name for name in HYDRA_FILES if (folder / ".hydra" / name).is_file()]
        if level > 0 and (folder / "hparams.yaml").is_file():  # the checkpoint's own folder is read already
            found.append(folder / "hparams.yaml")
        if folder.parent == folder:
            break
        folder = folder.parent
    return found


def label_of(config: Path, path: Path) -> str:
    start = path if path.is_dir() else path.parent
    return f"{os.path.relpath(config, start)}:"


def read_run_config(config: Path) -> dict[str, Any]:
    """The run config's settings (the caller sets aside one too large to read: `safe_yaml.set_aside_note`)."""
    text = config.read_bytes()
    data = read_settings(text, str(config), "yaml")
    if config.name == "overrides.yaml":
        return overrides_as_settings(config, data)
    if data is None:
        return {}
    settings_mapping(data, str(config))
    limit = max(MAX_RESOLVED, expansion_limit(len(text)))
    budget = [limit]
    resolved = resolve_references(data, data, budget=budget)
    if budget[0] < 0:  # `${...}` references that copy each other: an expansion bomb
        raise CheckpointError(f"{config}: its ${{...}} references expand past {limit:,} values; refusing it")
    return resolved


def overrides_as_settings(config: Path, data: Any) -> dict[str, Any]:
    """Hydra's overrides (`model.block_size=8`, `+loss.gamma=7`, `~x`) as dotted keys and YAML values."""
    import yaml

    if data is None:
        return {}
    if not isinstance(data, list):
        raise CheckpointError(f"{config}: expected a list of KEY=VALUE overrides, found {type(data).__name__}")
    settings: dict[str, Any] = {}
    for item in data:
        key, sep, raw = str(item).partition("=")
        key = key.lstrip("+")
        if not sep or key.startswith("~") or key.startswith("hydra.") or not key:
            continue  # a deletion, a Hydra runtime setting or a group choice without a value
        try:
            settings[key] = load_yaml(raw) if raw else raw
        except YamlLimit as exc:
            raise CheckpointError(f"{config}: override {key!r}: {exc}") from None
        except yaml.YAMLError:
            settings[key] = raw
    return settings


MAX_RESOLVED = 100_000


def resolve_references(node: Any, root: dict[str, Any], depth: int = 0, budget: list[int] | None = None) -> Any:
    budget = budget if budget is not None else [MAX_RESOLVED]
    budget[0] -= 1
    if budget[0] < 0:
        return UNRESOLVED
    if isinstance(node, dict):
        resolved = {}
        for key, value in node.items():
            value = resolve_references(value, root, depth + 1, budget)
            if value is not UNRESOLVED:
                resolved[key] = value
        return resolved
    if isinstance(node, list):
        return [resolve_references(v, root, depth + 1, budget) for v in node]
    if isinstance(node, str) and "${" in node:
        match = REFERENCE.match(node.strip())
        target: Any = root
        for part in (match.group(1).split(".") if match and depth < 20 else [None]):
            if not isinstance(target, dict) or part not in target:
                return UNRESOLVED
            target = target[part]
        return resolve_references(target, root, depth + 1, budget)
    return node


UNRESOLVED = object()

"""YAML read with limits checked before anything is built: size, nesting depth, aliases and the size
the document would have once its aliases are expanded.

PyYAML builds an alias as a second reference to one object, so an "alias bomb" (`a: &a [1, 1]`,
`b: &b [*a, *a]`, ...) loads in microseconds as a small graph; it explodes later, in whatever walks it
(resolving `${...}` references, turning it into settings). The composed node graph is measured first,
each distinct node once, and refused past the limits; only then is it constructed.

A big run's settings file can be large and real (an args.json listing every data shard), so the size bound is
generous and the expansion limit grows with the text: a document without aliases has fewer nodes than characters,
so only aliases can take it past `max(MAX_EXPANDED_NODES, len(text))`. libyaml parses it when installed (ten times
PyYAML's speed, and its own nesting bound); a settings file past `MAX_SETTINGS_BYTES` is set aside unread
(`set_aside_note`), its declarations unknown.

`read_settings` is the one reader of the settings files foreign checkpoints carry (args.json, a Hydra run's
config.yaml, a .nemo archive's model_config.yaml); `describe` is what a library's exception may add to a one-line
refusal: its first line, never an exception's name.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from foundation.errors import CheckpointError
from foundation.graph_walk import check_bounded

MAX_SETTINGS_BYTES = 256 << 20  # a settings file is kilobytes, a big run's args.json tens of megabytes
MAX_DEPTH = 64
MAX_ALIASES = 1_000
MAX_EXPANDED_NODES = 100_000


REFUSALS = {"expanded": f"its aliases expand it past {MAX_EXPANDED_NODES:,} values (an alias bomb)",
            "loop": "an alias refers to a node that contains it (a recursive alias)",
            "depth": f"nested deeper than {MAX_DEPTH} levels"}


class YamlLimit(ValueError):
    """A YAML document past the limits; the message says which."""


def load_yaml(text: str) -> Any:
    """`yaml.safe_load(text)` within the limits; YamlLimit past them, yaml.YAMLError for bad syntax."""
    import yaml

    if len(text) > MAX_SETTINGS_BYTES:
        raise YamlLimit(f"{len(text)} characters, more than a settings file's {MAX_SETTINGS_BYTES >> 20} MiB")
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)(text)
    try:
        try:
            node = loader.get_single_node()
        except RecursionError:  # PyYAML's composer
            raise YamlLimit(REFUSALS["depth"]) from None
        except yaml.MarkedYAMLError as exc:  # libyaml's own nesting bound (1,000 levels)
            if "maximum nesting depth" in str(exc.problem):
                raise YamlLimit(REFUSALS["depth"]) from None
            raise
        if node is None:
            return None
        check_nodes(node, expansion_limit(len(text)))
        return loader.construct_document(node)
    finally:
        loader.dispose()


def expansion_limit(characters: int) -> int:
    """How many values a document of `characters` may expand to: past it, aliases or references multiply it."""
    return max(MAX_EXPANDED_NODES, characters)


def check_nodes(root, max_expanded: int = MAX_EXPANDED_NODES) -> None:
    """YamlLimit if the node graph nests too deep, has too many aliases, loops, or expands too far."""
    import yaml

    aliases = 0

    def alias() -> None:  # a node reached again
        nonlocal aliases
        aliases += 1
        if aliases > MAX_ALIASES:
            raise YamlLimit(f"more than {MAX_ALIASES} aliases")

    def children(node) -> list | None:
        if isinstance(node, yaml.ScalarNode):
            return None
        return [c for pair in node.value for c in pair] if isinstance(node, yaml.MappingNode) else list(node.value)

    check_bounded(root, children, MAX_DEPTH, max_expanded, lambda kind: YamlLimit(REFUSALS[kind]),
                  on_shared=alias)


INTERNAL_NAME = re.compile(r"\b[A-Z]\w*(Error|Exception)\b|Traceback")


def describe(exc: BaseException, fallback: str = "truncated or corrupt") -> str:
    lines = str(exc).strip().splitlines()
    line = lines[0][:160] if lines else ""
    return fallback if not line or INTERNAL_NAME.search(line) else line


def set_aside_note(path: Path) -> str | None:
    """Why a settings file beside a checkpoint is not read (past MAX_SETTINGS_BYTES), or None to read it."""
    size = path.stat().st_size
    if size <= MAX_SETTINGS_BYTES:
        return None
    return (f"{size:,} bytes, past the {MAX_SETTINGS_BYTES >> 20} MiB a settings file is read to: set aside unread, "
            "what it declares stays unknown")


def read_settings(data: bytes, where: str, kind: str, limit: int = MAX_SETTINGS_BYTES) -> Any:
    """A settings file's content (`kind` "json" or "yaml") parsed within the limits; CheckpointError naming
    `where` (the file, or the archive and its member) when it is too large, not UTF-8 or not readable."""
    if len(data) > limit:
        raise CheckpointError(f"{where}: {len(data)} bytes, more than a settings file's {limit >> 20} MiB; "
                              "refusing to read it")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise CheckpointError(f"{where}: not UTF-8 text") from None
    try:
        return json.loads(text) if kind == "json" else load_yaml(text)
    except Exception as exc:  # JSON or YAML syntax, or past the limits
        raise CheckpointError(f"{where}: unreadable {kind} ({describe(exc)})") from exc


def settings_mapping(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise CheckpointError(f"{where}: expected a mapping of settings, found {type(value).__name__}")
    return value

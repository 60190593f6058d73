"""Where the tool keeps what it can rebuild (hidden-state caches, the demo and test worlds), and
the one way anything there is built: under a file lock, once, by whichever process gets there first.

The root is `--cache-dir` when a verb is given one, else `$XDG_CACHE_HOME/dflash-audit`
(`~/.cache/dflash-audit`): never the current or the repository folder.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from filelock import FileLock

T = TypeVar("T")


def cache_root(override: str | Path | None = None) -> Path:
    if override is not None:
        return Path(override)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "dflash-audit"


def build_once(lock_path: Path, built: Callable[[], T | None], build: Callable[[], T]) -> T:
    """`built()` if it finds the artefact, else `build()`; concurrent processes build it once.

    `built` is asked again after the lock is taken: the process that waited finds what the
    other one built."""
    found = built()
    if found is not None:
        return found
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(lock_path)):
        found = built()
        return found if found is not None else build()

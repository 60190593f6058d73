"""Where the tool keeps what it can rebuild (hidden-state caches, the demo and test worlds), and
the one way anything there is built: under a file lock, once, by whichever process gets there first.

The root is `--cache-dir` when a verb is given one, else `$XDG_CACHE_HOME/dflash-audit`
(`~/.cache/dflash-audit`): never the current or the repository folder.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from filelock import FileLock

from foundation.atomic import atomic_write_text, missing_folders, remove_if_empty

T = TypeVar("T")


def cache_root(override: str | Path | None = None) -> Path:
    if override is not None:
        return Path(override)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "dflash-audit"


def build_once(lock_path: Path, built: Callable[[], T | None], build: Callable[[], T]) -> T:
    """`built()` if it finds the artefact, else `build()`; concurrent processes build it once.

    `built` is asked again after the lock is taken: the process that waited finds what the
    other one built. A build that fails (a full disk, an interrupt) takes back the lock file and the
    folders it made, once empty: what `build` wrote it removes itself."""
    found = built()
    if found is not None:
        return found
    made = missing_folders(lock_path.parent)
    had_lock = lock_path.exists()
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    try:
        with FileLock(str(lock_path)):
            found = built()
            return found if found is not None else build()
    except BaseException:
        if not had_lock:
            lock_path.unlink(missing_ok=True)
        remove_if_empty(made)
        raise


def read_kept(path: Path) -> Any | None:
    """A kept answer (JSON) at `path`, or None where none is kept or it cannot be read: asked anew."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None


def keep(path: Path, answer: Any) -> None:
    """Keep `answer` (JSON) at `path`, written whole or not at all. An answer that cannot be written (a read-only or
    full cache root) costs the next process the question again, nothing more."""
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, json.dumps(answer))
    except (OSError, ValueError):
        pass

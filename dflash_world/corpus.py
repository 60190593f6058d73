"""Training text every machine already has: the running Python's standard library."""

from __future__ import annotations

import hashlib
import sysconfig
from pathlib import Path

# Directories left out: third-party code, test suites (huge, repetitive, and full of
# deliberately odd code), the GUI / 2to3 trees whose style is atypical, and data
# dressed as code (codec tables, pydoc's one 750 kB string).
EXCLUDED_DIRS = frozenset({
    "site-packages", "test", "tests", "idlelib", "lib2to3", "tkinter", "__pycache__",
    "encodings", "pydoc_data",
})
HELDOUT_PERCENT = 10
DEFAULT_MAX_BYTES = 4_000_000

SPLITS = ("train", "heldout")


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def split_of(content: bytes) -> str:
    """Train or held-out, decided by a hash of the file's bytes: a file never changes
    side when the byte budget or the file set changes, and identical files (stub
    `__init__.py`s) land on the same side."""
    digest = hashlib.sha256(content).digest()
    return "heldout" if digest[0] * 100 // 256 < HELDOUT_PERCENT else "train"


def stdlib_files(root: Path | None = None) -> list[Path]:
    """The library's .py files, sorted by relative path (POSIX form)."""
    root = root or stdlib_dir()
    files = [
        path
        for path in root.rglob("*.py")
        if not EXCLUDED_DIRS.intersection(path.relative_to(root).parts[:-1])
    ]
    return sorted(files, key=lambda path: path.relative_to(root).as_posix())


def stdlib_corpus(
    split: str = "train", *, max_bytes: int = DEFAULT_MAX_BYTES, root: Path | None = None
) -> list[str]:
    """Texts of one split, in path order, up to `max_bytes` of UTF-8 in total.

    The budget is filled in an order fixed by a hash of each path rather than
    alphabetically, so a small budget still samples the whole library instead of
    `asyncio/` and the modules before it. Files that would overflow the budget are
    skipped (later, smaller ones may still fit); undecodable or empty files too.
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, not {split!r}")
    root = root or stdlib_dir()
    relative = {path: path.relative_to(root).as_posix() for path in stdlib_files(root)}
    chosen: dict[str, str] = {}
    used = 0
    for path in sorted(relative, key=lambda p: hashlib.sha256(relative[p].encode()).digest()):
        raw = path.read_bytes()
        if split_of(raw) != split or not raw.strip() or used + len(raw) > max_bytes:
            continue
        try:
            chosen[relative[path]] = raw.decode("utf-8")
        except UnicodeDecodeError:
            continue
        used += len(raw)
    return [chosen[name] for name in sorted(chosen)]

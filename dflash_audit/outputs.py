"""Where the tool may write: checked before any work, so an output never destroys an input
or anything else the tool did not make.

- an output may not be an input, contain one (a report directory around a drafter), or
  lie inside an input directory (compared through symlinks: `Path.resolve`);
- an existing destination is replaced only when it is a drafter of the format being
  written, holding nothing but that drafter's files, and `--force` is given;
- the destination must be writable (probed by creating its temp folder; see foundation.atomic).
"""

from __future__ import annotations

import fnmatch
import os
from pathlib import Path

from foundation.atomic import TMP_DIR, probe_destination
from foundation.errors import AuditError

# The files a drafter directory of each format consists of; anything else there is someone else's.
DRAFTER_FILES = ("config.json", "generation_config.json", "*.safetensors", "model.safetensors.index.json")


def _overlap(output: Path, given: Path) -> str | None:
    """How the (resolved) output collides with an input, or None."""
    # realpath, not Path.resolve: a symbolic link loop must not raise here (it is refused where it is read).
    out, inp = Path(os.path.realpath(output)), Path(os.path.realpath(given))
    if out == inp:
        return "is"
    if out in inp.parents:
        return "contains"
    if inp.is_dir() and inp in out.parents:
        return "is inside"
    return None


def check_outputs(outputs: dict[str, Path | None], inputs: dict[str, Path | None]) -> None:
    """AuditError naming both flags if an output is, contains or lies inside an input."""
    for out_flag, output in outputs.items():
        if output is None:
            continue
        for in_flag, given in inputs.items():
            if given is None:
                continue
            how = _overlap(Path(output), Path(given))
            if how is not None:
                raise AuditError(f"{out_flag} {output} {how} the input {in_flag} {given}; "
                                 "choose another output path")


def check_writable(flag: str, path: Path, kind: str = "file") -> None:
    """One line naming the flag if `path` (a `file` or a `dir` to write) cannot be written;
    also clears its leftover temp files."""
    try:
        _check_writable(flag, Path(path), kind)
    except OSError as exc:  # a loop, a name too long, a file where a folder should be: named, with the flag
        from dflash_audit.faults import fault_words

        raise AuditError(f"{flag} {path}: cannot write there ({fault_words(exc)})") from None


def _check_writable(flag: str, path: Path, kind: str) -> None:
    if path.is_symlink():
        raise AuditError(f"{flag} {path}: a symbolic link; give the real path to write")
    if path.exists() and kind == "file" and not path.is_file():
        raise AuditError(f"{flag} {path}: exists and is not a regular file")
    if path.exists() and kind == "dir" and not path.is_dir():
        raise AuditError(f"{flag} {path}: exists and is not a directory")
    try:
        probe_destination(path.absolute())
    except ValueError as exc:  # foundation.atomic.OutputError
        raise AuditError(f"{flag} {exc}") from None


def _foreign_entries(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir()
                  if p.name != TMP_DIR and not (p.is_file() and any(fnmatch.fnmatch(p.name, g) for g in DRAFTER_FILES)))


def check_replaceable(flag: str, destination: Path, fmt: str, force: bool) -> None:
    """An existing destination may be replaced only if it is a `fmt` drafter and --force is given."""
    from dflash_audit.formats import detect_format

    if destination.is_symlink():  # replacing it would replace the link, not what it points to
        raise AuditError(f"{flag} {destination}: a symbolic link; refusing to replace it (give a real path)")
    if not destination.exists():
        return
    try:
        found = detect_format(destination)
    except AuditError:
        found = None
    if found != fmt:
        raise AuditError(f"{flag} {destination}: already exists and is not a {fmt} drafter; "
                         "refusing to replace it (choose a new path)")
    if destination.is_dir():
        foreign = _foreign_entries(destination)
        if foreign:
            raise AuditError(f"{flag} {destination}: a {fmt} drafter that also holds {foreign[:3]}; "
                             "refusing to replace files the tool did not write")
    if not force:
        raise AuditError(f"{flag} {destination}: a {fmt} drafter already exists there; pass --force to replace it")


# -- files the tool writes over: only its own ---------------------------------------------------
OWN_SCHEMA_PREFIX = "dflash-audit"  # dflash-audit/1, dflash-audit/eval/1, dflash-audit-serving/1 ...
HTML_MARK = "<title>dflash-audit"  # every report page the tool writes has this title (compare, serve-check)
# Keys of JSON files written before they carried a schema tag (eval --json, train --json).
LEGACY_JSON_KEYS = ({"method", "mode", "prompts", "mean_tau"}, {"out", "steps", "seconds", "final"})
SNIFF_BYTES = 1 << 16


def _head(path: Path) -> str:
    try:
        with open(path, "rb") as handle:
            return handle.read(SNIFF_BYTES).decode("utf-8", errors="replace")
    except OSError:
        return ""


def written_by_us(path: Path) -> bool:
    """Whether an existing regular file is one of the tool's own reports (its schema tag, or its page title)."""
    import json

    if not path.is_file():
        return False
    if path.suffix in (".html", ".htm"):
        return HTML_MARK in _head(path)
    if path.stat().st_size > 64 << 20:
        return False
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):  # not JSON, or nested past the stack: not one of ours
        return False
    if not isinstance(data, dict):
        return False
    schema = data.get("schema")
    if isinstance(schema, str) and schema.startswith(OWN_SCHEMA_PREFIX):
        return True
    return any(keys <= set(data) for keys in LEGACY_JSON_KEYS)


def check_not_foreign(flag: str, path: Path, force: bool, names: tuple[str, ...] = ()) -> None:
    """`path` (or, for a report folder, each of `names` in it) is absent, the tool's own earlier report, or
    `--force` was given: a user's file is never replaced silently."""
    path = Path(path)
    files = [path / name for name in names] if names else [path]
    for file in files:
        if file.exists() and not force and not written_by_us(file):
            raise AuditError(f"{flag} {path}: {file.name if names else 'the file'} exists and was not written by "
                             "dflash-audit; refusing to replace it (choose another path, or pass --force to replace it)")


def check_cache_dir(cache_dir: Path | None, inputs: dict[str, Path | None]) -> None:
    """--cache-dir: a folder (or a new one), never an input nor inside an input folder (the cache
    writes files and a lock there)."""
    if cache_dir is None:
        return
    cache_dir = Path(cache_dir)
    if cache_dir.exists() and not cache_dir.is_dir():
        raise AuditError(f"--cache-dir {cache_dir}: exists and is not a directory")
    for in_flag, given in inputs.items():
        if given is None:
            continue
        how = _overlap(cache_dir, Path(given))
        if how in ("is", "is inside"):
            raise AuditError(f"--cache-dir {cache_dir} {how} the input {in_flag} {given}; the cache would write "
                             "files there: choose another cache folder")
    probe = cache_dir.absolute() / "offline"  # a byte written (and taken back) where the cache will write
    try:
        probe_destination(probe)
    except (OSError, ValueError) as exc:  # foundation.atomic.OutputError, or a folder that cannot be made
        from dflash_audit.faults import fault_words

        why = fault_words(exc) if isinstance(exc, OSError) else str(exc).removeprefix(f"{probe}: ")
        raise AuditError(f"--cache-dir {cache_dir}: {why}") from None

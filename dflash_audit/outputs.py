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
from pathlib import Path

from foundation.atomic import TMP_DIR, probe_destination
from foundation.errors import AuditError

# The files a drafter directory of each format consists of; anything else there is someone else's.
DRAFTER_FILES = ("config.json", "generation_config.json", "*.safetensors", "model.safetensors.index.json")


def _overlap(output: Path, given: Path) -> str | None:
    """How the (resolved) output collides with an input, or None."""
    out, inp = output.resolve(), given.resolve()
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
    path = Path(path)
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

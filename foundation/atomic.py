"""Atomic writes that leave nothing behind and respect the umask.

A file or directory is built under a hidden `.dflash-audit-tmp/` folder beside its
destination (same filesystem, so the final rename is atomic), then renamed into place.
A process killed mid-write (SIGKILL runs no cleanup) leaves its temp entry there; the
next write to the same destination removes it. Temp entries get the permissions any
other new file would (0666 / 0777 masked by the umask), not mkstemp's private 0600 / 0700.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from pathlib import Path

TMP_DIR = ".dflash-audit-tmp"
TMP_TAG = ".tmp-"  # `<name>.tmp-<mkstemp's 8 random chars>`


class OutputError(ValueError):
    """A destination that cannot be written; one line naming the destination, never a temp name."""


def current_umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def temp_folder(path: Path) -> Path:
    return Path(path).parent / TMP_DIR


def _is_leftover(entry: str, name: str) -> bool:
    return re.fullmatch(re.escape(name) + re.escape(TMP_TAG) + r"[a-z0-9_]{8}", entry) is not None


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _tidy(folder: Path) -> None:
    """Drop the temp folder once nothing is left in it (another writer may still use it)."""
    try:
        folder.rmdir()
    except OSError:
        pass


def _in_temp_folder(folder: Path, make):
    """`make(folder)` (mkstemp / mkdtemp there). A concurrent writer (another rank) may tidy the
    empty folder away between our mkdir and now: recreate it and try again. Once our entry is in
    it the folder is not empty, so no one else's tidy can remove it."""
    for _ in range(8):
        try:
            return make(folder)
        except FileNotFoundError:
            folder.mkdir(parents=True, exist_ok=True)
    return make(folder)


def _created_and_listed(folder: Path) -> list[str]:
    folder.mkdir(parents=True, exist_ok=True)
    return os.listdir(folder)


def prepare_destination(path: str | Path) -> Path:
    """Create the destination's parent and temp folder, remove this destination's leftovers;
    returns the temp folder. OutputError naming `path` if it cannot be written there."""
    path = Path(path).absolute()
    folder = temp_folder(path)
    try:
        # A concurrent writer's tidy may remove the empty folder between our mkdir and listdir.
        entries = _in_temp_folder(folder, _created_and_listed)
    except OSError as exc:
        raise OutputError(f"{path}: cannot write there ({exc.strerror or type(exc).__name__})") from None
    for entry in entries:
        if _is_leftover(entry, path.name):
            _remove(folder / entry)
    return folder


def probe_destination(path: str | Path) -> None:
    """Check, before any work, that `path` can be written; cleans its leftover temp files."""
    _tidy(prepare_destination(path))


def _default_modes(root: Path) -> None:
    """Everything under `root` (all written by us) gets the umask's modes, not mkdtemp's or safetensors' 0600/0700."""
    mask = current_umask()
    root.chmod(0o777 & ~mask)
    for folder, dirs, files in os.walk(root):
        for name in dirs:
            os.chmod(os.path.join(folder, name), 0o777 & ~mask)
        for name in files:
            os.chmod(os.path.join(folder, name), 0o666 & ~mask)


def _fail(path: Path, exc: OSError) -> OutputError:
    return OutputError(f"{path}: cannot write ({exc.strerror or type(exc).__name__})")


def atomic_write_bytes(path: str | Path, write) -> None:
    """Call `write(tmp_path)` then rename the temp file onto `path`."""
    path = Path(path)
    folder = prepare_destination(path)
    fd, tmp = _in_temp_folder(folder, lambda where: tempfile.mkstemp(prefix=path.name + TMP_TAG, dir=where))
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, 0o666 & ~current_umask())  # after: some writers (safetensors) recreate the file 0600
        os.replace(tmp, path)
    except OSError as exc:
        Path(tmp).unlink(missing_ok=True)
        raise _fail(path, exc) from None
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    finally:
        _tidy(folder)


def atomic_directory(path: str | Path, fill) -> None:
    """Call `fill(tmp_dir)` then move the directory into place. An existing `path` is replaced
    (callers decide whether it may be: see dflash_audit.outputs); it is parked in the temp
    folder between the two renames, so a crash there leaves it for the next write to remove."""
    path = Path(path)
    folder = prepare_destination(path)
    tmp = Path(_in_temp_folder(folder, lambda where: tempfile.mkdtemp(prefix=path.name + TMP_TAG, dir=where)))
    old = None
    try:
        fill(tmp)
        _default_modes(tmp)
        if path.exists():
            old = Path(tempfile.mkdtemp(prefix=path.name + TMP_TAG, dir=folder))
            os.replace(path, old / "old")
            try:
                os.replace(tmp, path)
            except BaseException:
                os.replace(old / "old", path)  # put the old one back
                raise
        else:
            os.replace(tmp, path)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise _fail(path, exc) from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        _tidy(folder)

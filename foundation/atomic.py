"""Atomic writes that leave nothing behind and respect the umask.

A file or directory is built under a hidden `.dflash-audit-tmp/` folder beside its
destination (same filesystem, so the final rename is atomic), then renamed into place.
A process killed mid-write (SIGKILL runs no cleanup) leaves its temp entry there; the
next write to the same destination removes it. Temp entries get the permissions any
other new file would (0666 / 0777 masked by the umask), not mkstemp's private 0600 / 0700.
"""

from __future__ import annotations

import errno
import hashlib
import os
import re
import shutil
import tempfile
from pathlib import Path

from foundation.errors import printable

TMP_DIR = ".dflash-audit-tmp"
TMP_TAG = ".tmp-"  # `<name>.tmp-<writer's pid>-<mkstemp's 8 random chars>`


class OutputError(ValueError):
    """A destination that cannot be written; one line naming the destination, never a temp name."""


def current_umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def temp_folder(path: Path) -> Path:
    return Path(path).parent / TMP_DIR


NAME_MAX = 255  # bytes in one file name on every Linux file system we write to
TEMP_SUFFIX_LEN = len(TMP_TAG) + 8 + 8  # the tag, a pid of up to 7 digits and a dash, mkstemp's 8 characters


def temp_stem(name: str) -> str:
    """The temp entries' prefix for destination `name`: the name itself, or for a name so long that the
    temp suffix would push it past NAME_MAX (a legal name must stay writable), its start and a hash."""
    if len(os.fsencode(name)) + TEMP_SUFFIX_LEN <= NAME_MAX:
        return name
    digest = hashlib.sha256(os.fsencode(name)).hexdigest()[:12]
    return name[:50] + "~" + digest  # at most 4 bytes a character: well under NAME_MAX


def _is_leftover(entry: str, name: str) -> bool:
    """A temp entry for `name` whose writer is gone (killed mid-write). One whose writer still runs (a
    concurrent write to the same destination) is its, not a leftover: removing it would break that write."""
    match = re.fullmatch(re.escape(temp_stem(name)) + re.escape(TMP_TAG) + r"(?:(\d+)-)?[a-z0-9_]{8}", entry)
    return match is not None and (match.group(1) is None or not _alive(int(match.group(1))))


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return False  # this process writes one destination at a time: its own entry here is a leftover
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process: alive
        return True
    return True


def _prefix(path: Path) -> str:
    return f"{temp_stem(path.name)}{TMP_TAG}{os.getpid()}-"


def _name_max(folder: Path) -> int:
    try:
        return os.pathconf(folder, "PC_NAME_MAX")
    except (OSError, ValueError):
        return NAME_MAX


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
    longest = max((part for part in path.parts), key=lambda part: len(os.fsencode(part)))
    limit = _name_max(path.parent) if path.parent.is_dir() else NAME_MAX
    if len(os.fsencode(longest)) > limit:
        raise OutputError(f"{path}: cannot write there (file name too long: {len(os.fsencode(longest))} bytes in "
                          f"one name, the file system allows {limit})")
    try:
        # A concurrent writer's tidy may remove the empty folder between our mkdir and listdir.
        entries = _in_temp_folder(folder, _created_and_listed)
    except OSError as exc:
        raise OutputError(f"{path}: cannot write there ({exc.strerror or 'the folder cannot be made'})") from None
    for entry in entries:
        if _is_leftover(entry, path.name):
            _remove(folder / entry)
    return folder


def probe_destination(path: str | Path) -> None:
    """Check, before any work, that `path` can be written, a byte of it too (a full tmpfs still makes empty files
    and folders); cleans its leftover temp files. Folders it had to make are removed again: the write makes them."""
    path = Path(path).absolute()
    made = missing_folders(path.parent)
    try:
        folder = prepare_destination(path)
        fd, tmp = _make_temp(folder, path, tempfile.mkstemp)
        try:
            try:
                os.write(fd, b"\0")
            finally:
                os.close(fd)
        except OSError as exc:
            raise _fail(path, exc) from None
        finally:
            Path(tmp).unlink(missing_ok=True)
            _tidy(folder)
    finally:
        remove_if_empty(made)


def missing_folders(folder: Path) -> list[Path]:
    """`folder` and those of its ancestors that do not exist yet, deepest first."""
    missing = []
    for candidate in [folder, *folder.parents]:
        if candidate.exists() or candidate.is_symlink():
            break
        missing.append(candidate)
    return missing


def remove_if_empty(folders: list[Path]) -> None:
    """rmdir each folder (deepest first) that is still empty: one another process filled stays."""
    for folder in folders:
        try:
            folder.rmdir()
        except OSError:
            return


def _default_modes(root: Path) -> None:
    """Everything under `root` (all written by us) gets the umask's modes, not mkdtemp's or safetensors' 0600/0700."""
    mask = current_umask()
    root.chmod(0o777 & ~mask)
    for folder, dirs, files in os.walk(root):
        for name in dirs:
            os.chmod(os.path.join(folder, name), 0o777 & ~mask)
        for name in files:
            os.chmod(os.path.join(folder, name), 0o666 & ~mask)


def _fail(path: Path, exc: BaseException) -> OutputError:
    if isinstance(exc, OSError) and exc.errno in (errno.ENOTEMPTY, errno.EEXIST):
        return OutputError(f"{path}: cannot write (another process wrote it at the same moment; it holds that "
                           "write, whole)")
    reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else write_fault(exc)
    return OutputError(f"{path}: cannot write ({reason or 'the write failed'})")


# What libraries that write without raising OSError (safetensors' writer, torch's zip writer) say when
# the disk is full or read-only.
WRITE_FAULT_TEXTS = (("No space left on device", "No space left on device"),
                     ("Read-only file system", "Read-only file system"),
                     ("File name too long", "File name too long"),
                     ("Disk quota exceeded", "Disk quota exceeded"),
                     ("file write failed", "the write failed; is the disk full?"),
                     ("unexpected pos", "the write failed; is the disk full?"))


def write_fault(exc: BaseException) -> str | None:
    text = str(exc)
    return next((fault for needle, fault in WRITE_FAULT_TEXTS if needle in text), None)


def _make_temp(folder: Path, path: Path, make):
    """`make(folder, prefix)` (mkstemp / mkdtemp); on failure the temp folder is tidied and the fault named."""
    try:
        return _in_temp_folder(folder, lambda where: make(prefix=_prefix(path), dir=where))
    except OSError as exc:
        _tidy(folder)
        raise _fail(path, exc) from None


def atomic_write_bytes(path: str | Path, write) -> None:
    """Call `write(tmp_path)` then rename the temp file onto `path`."""
    path = Path(path)
    folder = prepare_destination(path)
    fd, tmp = _make_temp(folder, path, tempfile.mkstemp)
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, 0o666 & ~current_umask())  # after: some writers (safetensors) recreate the file 0600
        os.replace(tmp, path)
    except OSError as exc:
        Path(tmp).unlink(missing_ok=True)
        raise _fail(path, exc) from None
    except BaseException as exc:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(exc, Exception) and write_fault(exc):
            raise _fail(path, exc) from None
        raise
    finally:
        _tidy(folder)


def atomic_write_text(path: str | Path, text: str) -> None:
    """A report's text written whole (temp file, then rename) as UTF-8, any file name in it that is not UTF-8 (a
    Linux name may hold any bytes) shown as \\xNN (`printable`): the one way a report reaches the disk."""
    shown = printable(text)
    atomic_write_bytes(path, lambda tmp: Path(tmp).write_text(shown, encoding="utf-8"))


def atomic_directory(path: str | Path, fill) -> None:
    """Call `fill(tmp_dir)` then move the directory into place. An existing `path` is replaced
    (callers decide whether it may be: see dflash_audit.outputs); it is parked in the temp
    folder between the two renames, so a crash there leaves it for the next write to remove."""
    path = Path(path)
    folder = prepare_destination(path)
    tmp = Path(_make_temp(folder, path, tempfile.mkdtemp))
    old = None
    try:
        fill(tmp)
        _default_modes(tmp)
        if path.exists():
            old = Path(tempfile.mkdtemp(prefix=_prefix(path), dir=folder))
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
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(exc, Exception) and write_fault(exc):
            raise _fail(path, exc) from None
        raise
    finally:
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        _tidy(folder)

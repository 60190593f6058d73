"""The marks by which the recorder tells `dflash-audit trace` how far the traced command got: files in a folder of
the verb's own (never in --out), named in the environment, one per process and kind. `installed.<pid>`: the bootstrap
installed the recorder in that process; `install-failed.<pid>`: it could not (the file says why); `stepped.<pid>`:
that process began its first training step, or its first evaluation round; `exited.<pid>`: it reached Python's
normal exit, where the recorder writes what it holds. The standard library only: the bootstrap writes a mark even
in a Python that cannot import the recorder's dependencies."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

ENV_MARKS = "DFLASH_AUDIT_TRACE_MARKS"


class Mark:
    """The marks' names."""

    INSTALLED = "installed"
    INSTALL_FAILED = "install-failed"
    STEPPED = "stepped"
    EXITED = "exited"


def mark(what: str, text: str = "") -> None:
    """Leave the mark `what` for this process (a few bytes; nothing when the verb asked for no marks, or its folder
    is gone)."""
    folder = os.environ.get(ENV_MARKS)
    if not folder:
        return
    with contextlib.suppress(OSError):
        (Path(folder) / f"{what}.{os.getpid()}").write_text(text)


def marked(folder: Path, what: str) -> dict[int, str]:
    """The processes that left the mark `what`, with its text."""
    found = {}
    for path in Path(folder).glob(f"{what}.*"):
        pid = path.name[len(what) + 1:]
        if pid.isdigit():
            with contextlib.suppress(OSError):
                found[int(pid)] = path.read_text(errors="replace")
    return found

"""The one line for a failure no check caught: an operating-system fault names its path and the
fault in words; anything else says it was unforeseen and ends "rerun with --debug". Neither ever
shows a Python exception class name (the user did not write Python).

Every message that reaches this module is a defect to fix where the value is read; this is the
net under those checks, not a replacement for them.
"""

from __future__ import annotations

import errno
import os
import re

from foundation.errors import plain_reason

FAULTS = {
    errno.EROFS: "read-only file system",
    errno.ENOSPC: "no space left on device",
    errno.EDQUOT: "disk quota exceeded",
    errno.ENAMETOOLONG: "file name too long",
    errno.ELOOP: "a symbolic link loop",
    errno.ENOTDIR: "a path component is not a directory",
    errno.EISDIR: "a directory, not a file",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
    errno.ENOENT: "no such file or directory",
    errno.EEXIST: "already exists",
    errno.ENXIO: "no such device (a FIFO without a writer, or a socket)",
    errno.EIO: "input/output error",
    errno.EMFILE: "too many open files",
    errno.ENOMEM: "out of memory",
    errno.EXDEV: "on another file system",
}
# Faults libraries report without an errno: the text they use, and what it means.
TEXT_FAULTS = (
    ("No space left on device", "no space left on device"),
    ("Read-only file system", "read-only file system"),
    ("File name too long", "file name too long"),
    ("Symlink loop", "a symbolic link loop"),
    ("file write failed", "the write failed (the disk may be full)"),
    ("can't allocate memory", "out of memory"),
    ("not enough memory", "out of memory"),
    ("DefaultCPUAllocator", "out of memory"),
)


def clean(text: str) -> str:
    """One line, no terminal escapes, no exception class names."""
    return plain_reason(text, limit=2000)


def fault_words(exc: OSError) -> str:
    """What an OSError's errno means, in words."""
    return FAULTS.get(exc.errno) or clean(exc.strerror or "") or errno.errorcode.get(exc.errno, "fault")


def os_fault(exc: BaseException) -> str | None:
    """`PATH: FAULT` for an OSError (or a library's text for one), None when it is none."""
    if isinstance(exc, OSError) and exc.errno is not None:
        fault = fault_words(exc)
        where = " -> ".join(str(name) for name in (exc.filename, exc.filename2) if name is not None)
        return f"{where}: {fault}" if where else fault
    text = str(exc)
    for needle, fault in TEXT_FAULTS:
        if needle in text:
            path = re.search(r"(?:from|file|path) '?(/[^\s',]+)", text)
            return f"{path.group(1)}: {fault}" if path else fault
    if isinstance(exc, MemoryError):
        return "out of memory"
    if isinstance(exc, RecursionError):
        return "an input nested too deeply to read"
    return None


# A file to which every unforeseen fault appends its line: the test suite names one, so that a subprocess (a demo
# run, a CLI run, a fuzz example) reaching this net fails the test that ran it, as an in-process one does.
UNFORESEEN_LOG = "DFLASH_AUDIT_UNFORESEEN_LOG"


def unforeseen(exc: BaseException) -> str:
    """The line for a fault nobody foresaw: what it said, cleaned, and how to see more."""
    said = clean(str(exc))[:300]
    line = f"unexpected failure{': ' + said if said else ''}; rerun with --debug"
    log = os.environ.get(UNFORESEEN_LOG)
    if log:
        with open(log, "a", encoding="utf-8") as record:  # one short append; never the user's file
            record.write(f"{os.getpid()}: {line}\n")
    return line

"""A command the tool starts, in its own process group, and stopped as a group: whatever it starts (a launcher's
workers, a shell's children, a script's own subprocesses) is signalled and ended with it, and nothing of it outlives
the tool. The group is a new session (`setsid`), so that the terminal's Ctrl-C reaches the tool alone, which passes
it on, and the command may still read the terminal (a new session has none of its own, so no job control stops it).
On Linux the leader also gets SIGKILL if the tool dies, however it dies.

`run_bounded` runs a short probe (an engine's `--version`, a Python's import) under a time bound, its output
decoded whatever bytes it holds."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

STOP_WAIT_S = 10.0  # a group's own shutdown after SIGTERM / SIGINT, before what is left of it is killed
POLL_S = 0.05


def die_with_parent() -> None:
    """Run in the child before exec: it gets SIGKILL when the tool's process ends."""
    import ctypes

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def start_group(command: Sequence[str], **popen: object) -> subprocess.Popen:
    """`command` started as the leader of a new session and process group (its group id is its pid)."""
    return subprocess.Popen(list(command), start_new_session=True,
                            preexec_fn=die_with_parent if sys.platform == "linux" else None, **popen)


def signal_group(group: int, signum: int) -> None:
    """`signum` to every process of the group, the leader gone or not (nothing happens when none is left)."""
    try:
        os.killpg(group, signum)
    except (ProcessLookupError, PermissionError):
        pass


def members(group: int) -> list[int]:
    """The live processes of the group (an exited one not yet reaped by its parent is not live): read from /proc,
    else asked of the kernel as a whole (then any process of the group, a zombie included, counts)."""
    proc = Path("/proc")
    if not (proc / "self" / "stat").is_file():
        try:
            os.killpg(group, 0)
        except (ProcessLookupError, PermissionError):
            return []
        return [group]
    found = []
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2:].split()  # after `pid (comm)`: state, ppid, pgrp, ...
        if len(fields) > 2 and fields[2] == str(group) and fields[0] not in ("Z", "X"):
            found.append(int(entry.name))
    return found


def end_group(group: int, first: int = signal.SIGTERM, wait_s: float = STOP_WAIT_S) -> None:
    """Whatever is left of the group ended: `first` to it, up to `wait_s` for it to go, then SIGKILL. The leader, if
    it is the caller's child, is reaped by the caller."""
    if not members(group):
        return
    signal_group(group, first)
    deadline = time.monotonic() + wait_s
    while members(group) and time.monotonic() < deadline:
        time.sleep(POLL_S)
    if members(group):
        signal_group(group, signal.SIGKILL)
        deadline = time.monotonic() + wait_s
        while members(group) and time.monotonic() < deadline:
            time.sleep(POLL_S)


def run_bounded(command: Sequence[str], timeout_s: float, env: dict | None = None) -> subprocess.CompletedProcess:
    """`command` run to its end in its own group, its output (stdout, stderr) as text whatever bytes it printed
    (undecodable ones replaced). Past `timeout_s` the whole group is killed and subprocess.TimeoutExpired raised;
    OSError when it cannot start. Nothing it started is left running either way."""
    process = start_group(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    try:
        out, err = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        signal_group(process.pid, signal.SIGKILL)  # what the leader started holds its pipes: killed with it
        process.communicate()
        raise
    finally:
        if process.poll() is None:  # interrupted (Ctrl-C) while waiting
            signal_group(process.pid, signal.SIGKILL)
            process.wait()
        end_group(process.pid, signal.SIGKILL)
    return subprocess.CompletedProcess(list(command), process.returncode, out.decode("utf-8", "replace"),
                                       err.decode("utf-8", "replace"))

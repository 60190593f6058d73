"""An engine process (vLLM's driver, `llama-server`), started and stopped one way: in its own session, so that
stopping it stops every process it started (vLLM forks workers, a shell its children), and on Linux with a
parent-death signal, so that the kernel kills it if the audit itself dies, however it dies. Stopping is for its whole
process group: terminate (a hung engine is killed at once: a stopped process never handles SIGTERM), a bounded wait,
then kill whatever is left, and reap it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from typing import IO

STOP_WAIT_S = 10  # an engine's own shutdown (its workers, its sockets) before it is killed


def die_with_parent() -> None:
    """Run in the child before exec: it gets SIGKILL when the audit's process ends (strictly, the thread that started
    it: start an engine from the thread that waits on it)."""
    import ctypes

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def start_engine(command: Sequence[str], log: IO, env: Mapping[str, str]) -> subprocess.Popen:
    """The engine running `command`, its output (both streams) into `log`."""
    return subprocess.Popen(list(command), stdout=log, stderr=subprocess.STDOUT, env=dict(env), start_new_session=True,
                            preexec_fn=die_with_parent if sys.platform == "linux" else None)


def signal_group(process: subprocess.Popen, signum: int) -> None:
    """`signum` to every process of the engine's session (its group is its pid), the engine gone or not."""
    try:
        os.killpg(process.pid, signum)
    except (ProcessLookupError, PermissionError):  # nothing of it is left (its id is no longer its group)
        pass


def stop_engine(process: subprocess.Popen, hung: bool = False, wait_s: float = STOP_WAIT_S) -> None:
    """Stop the engine and everything it started: SIGTERM to its group (SIGKILL at once if `hung`), up to `wait_s`
    for the engine to exit, then SIGKILL to the group (what it left behind, e.g. a worker, goes too), then reap it.
    Also right for an engine that has exited on its own."""
    if process.poll() is None:
        signal_group(process, signal.SIGKILL if hung else signal.SIGTERM)
        try:
            process.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            pass
    signal_group(process, signal.SIGKILL)
    process.wait()

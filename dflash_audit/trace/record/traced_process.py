"""The traced command's life, seen from the verb: started as its own process group (foundation/process_group.py),
its output passed through with its last lines kept, SIGINT, SIGTERM and SIGHUP sent to the verb passed on to the
whole group (a second one kills it), `--timeout` bounding the time to its first training step, and the group ended
when its leader ends, so that nothing the command started outlives the trace."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from foundation.errors import AuditError
from foundation.process_group import STOP_WAIT_S, end_group, signal_group, start_group

POLL_S = 0.1
PASSED_ON = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@dataclass
class Ended:
    status: int  # the leader's, as subprocess gives it (a negative status: the signal that killed it)
    stderr_tail: list[str]  # its last non-blank lines
    stdout_tail: list[str]


class Interrupted(AuditError):
    """The verb was sent SIGINT, SIGTERM or SIGHUP while the command ran: the group was stopped. Exit 128 + the
    signal's number, as a shell reports a process that signal ended."""

    def __init__(self, signum: int, what: str):
        self.exit_status = 128 + signum
        super().__init__(f"{what}: stopped by {signal.Signals(signum).name} sent to dflash-audit, with every process "
                         "it started; nothing was recorded")


def run_in_group(command: list[str], env: dict, what: str, timeout_s: float | None = None,
                 begun: Callable[[], bool] = lambda: True) -> Ended:
    """Run `command` to its end in its own group; `begun()` says whether it has reached its first step (polled
    until it has, when `timeout_s` bounds that). Raises Interrupted (a signal), AuditError (it cannot start, or
    reached no step within `timeout_s`); whatever it started is gone when this returns or raises."""
    received: list[int] = []
    leader: list[subprocess.Popen] = []

    def pass_on(signum, frame) -> None:
        received.append(signum)
        if leader:
            signal_group(leader[0].pid, signum if len(received) == 1 else signal.SIGKILL)

    previous = {}
    if threading.current_thread() is threading.main_thread():  # Python runs handlers in the main thread only
        previous = {signum: signal.signal(signum, pass_on) for signum in PASSED_ON}
    try:
        try:
            process = start_group(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                  errors="replace")
        except OSError as exc:
            raise AuditError(f"{command[0]}: cannot run it ({exc.strerror or exc})") from None
        leader.append(process)
        if received:  # sent while it was starting
            signal_group(process.pid, received[0])
        err_tail: deque[str] = deque(maxlen=20)
        out_tail: deque[str] = deque(maxlen=50)
        readers = [threading.Thread(target=_forward, args=(process.stderr, sys.stderr, err_tail), daemon=True),
                   threading.Thread(target=_forward, args=(process.stdout, sys.stdout, out_tail), daemon=True)]
        for reader in readers:
            reader.start()
        timed_out = _wait(process, received, timeout_s, begun)
        # What the leader left behind (a helper it started in the background, which a shell has ignore SIGINT):
        # asked to terminate, then killed.
        end_group(process.pid, signal.SIGTERM)
        for reader in readers:
            reader.join(timeout=5)
    finally:
        if leader and leader[0].poll() is None:  # an error of the verb's own while it ran: nothing is left
            signal_group(leader[0].pid, signal.SIGKILL)
            leader[0].wait()
        if leader:
            end_group(leader[0].pid, signal.SIGKILL)
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    if received:
        raise Interrupted(received[0], what)
    if timed_out:
        raise AuditError(f"{what}: reached no training step within --timeout {timeout_s:g} s; stopped it and every "
                         "process it started")
    return Ended(process.returncode, list(err_tail), list(out_tail))


def _wait(process: subprocess.Popen, received: list[int], timeout_s: float | None,
          begun: Callable[[], bool]) -> bool:
    """Until the leader ends: a signal passed on, or the timeout reached, gives the group STOP_WAIT_S to end on its
    own before it is killed. Whether the timeout stopped it."""
    started = time.monotonic()
    kill_at = None
    timed_out = under_way = False
    while True:
        try:
            process.wait(timeout=POLL_S)
            return timed_out
        except subprocess.TimeoutExpired:
            pass
        now = time.monotonic()
        if received and kill_at is None:
            kill_at = now + STOP_WAIT_S
        if timeout_s is not None and not (timed_out or under_way) and now - started > timeout_s:
            under_way = begun()
            if not under_way:
                timed_out = True
                signal_group(process.pid, signal.SIGTERM)
                kill_at = now + STOP_WAIT_S
        if kill_at is not None and now > kill_at:
            signal_group(process.pid, signal.SIGKILL)


def _forward(stream, to, tail: deque[str]) -> None:
    """The command's output still reaches the user's terminal; its last lines are kept for the one line."""
    for line in stream:
        to.write(line)
        if line.strip():
            tail.append(line.rstrip())

"""How the traced process ends once the recorder has what it asked for. The recorder raises TraceStop (a SystemExit)
in the thread that took the step, and the script unwinds as for any exit; but Python's exit first waits for every
non-daemon thread the script started (a data loader's, a logger's, one of its own that never ends), so that exit
may never come. A daemon watcher, started with the stop, waits for the main thread to finish, gives the script's
other threads a bounded grace, then ends the process with the stop's status. The recording is already written by
then; what the script would still run at its exit (its atexit handlers) is what those threads held back anyway."""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time

THREADS_GRACE_S = 3.0  # the script's own threads, after its main thread has ended, before the process is ended
WATCHER = "dflash-audit-trace-end"


def live_threads(watcher: threading.Thread) -> list[threading.Thread]:
    """The script's threads Python's exit would wait for: non-daemon, alive, neither the main one nor the watcher."""
    main = threading.main_thread()
    return [t for t in threading.enumerate() if t.is_alive() and not t.daemon and t is not main and t is not watcher]


def end_after_main_thread(status: int, grace_s: float = THREADS_GRACE_S) -> None:
    """Start the watcher (once per process): when the main thread has ended and threads still hold the process
    `grace_s` later, stdout and stderr are flushed and the process exits with `status`."""
    if not threading.main_thread().is_alive() or any(t.name == WATCHER for t in threading.enumerate()):
        return  # already at Python's exit (the recorder's atexit writing the last step): no thread holds it now

    def watch() -> None:
        threading.main_thread().join()
        deadline = time.monotonic() + grace_s
        for thread in live_threads(threading.current_thread()):
            thread.join(max(0.0, deadline - time.monotonic()))
        if live_threads(threading.current_thread()):
            for stream in (sys.stdout, sys.stderr):
                with contextlib.suppress(Exception):
                    stream.flush()
            os._exit(status)

    threading.Thread(target=watch, name=WATCHER, daemon=True).start()

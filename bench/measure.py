"""Wall time and peak anonymous memory of a command, sampled from /proc/<pid>/status.

RssAnon counts the process's own heap (what an audit allocates); the pages of a file it
maps (a checkpoint read through mmap) are RssFile and the kernel can drop them at will,
so they do not count. Children's memory is summed in (a tool that forks is charged for it).
"""

from __future__ import annotations

import os
import subprocess
import threading
import time
from dataclasses import dataclass


@dataclass
class Measured:
    wall_s: float
    peak_anon_mb: float
    returncode: int
    stdout: str
    stderr: str


def rss_anon_kb(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1])
    except (FileNotFoundError, ProcessLookupError):
        pass
    return 0


def children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as handle:
            return [int(p) for p in handle.read().split()]
    except (FileNotFoundError, ProcessLookupError):
        return []


def tree_anon_kb(pid: int) -> int:
    return rss_anon_kb(pid) + sum(tree_anon_kb(child) for child in children(pid))


def measure(command: list[str], env: dict[str, str] | None = None, interval_s: float = 0.005) -> Measured:
    """Run `command` to completion, sampling its (and its children's) RssAnon every `interval_s`."""
    env = {**os.environ, **(env or {})}
    started = time.perf_counter()
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    peak = [0]
    done = threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], tree_anon_kb(proc.pid))
            time.sleep(interval_s)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    stdout, stderr = proc.communicate()
    wall = time.perf_counter() - started
    done.set()
    sampler.join()
    return Measured(wall, peak[0] / 1024, proc.returncode, stdout, stderr)

"""Progress of long runs on stderr: a live bar on a terminal, plain lines in a log.

Both say the items done, tokens per second and the time left; neither touches a result.
"""

from __future__ import annotations

import contextlib
import time

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

LOG_EVERY_S = 10.0  # plain lines: at most one per interval, plus the last


def eta_text(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class PlainProgress:
    """`advance(tokens)` per item; a line `description: 3/8 prompts, 412 tok/s, ETA 0:00:12` now and then."""

    def __init__(self, console: Console, description: str, total: int, unit: str = "prompts", clock=time.monotonic):
        self.console, self.description, self.total, self.unit, self.clock = console, description, total, unit, clock
        self.done, self.tokens, self.start = 0, 0, clock()
        self.last_line = self.start

    def line(self) -> str:
        elapsed = max(self.clock() - self.start, 1e-9)
        rate = self.tokens / elapsed
        eta = (elapsed / self.done * (self.total - self.done)) if self.done else None
        speed = f"{rate:.0f} tok/s, " if self.tokens else ""
        return f"{self.description}: {self.done}/{self.total} {self.unit}, {speed}ETA {eta_text(eta)}"

    def advance(self, tokens: int = 0) -> None:
        self.done += 1
        self.tokens += tokens
        now = self.clock()
        if self.done >= self.total or now - self.last_line >= LOG_EVERY_S:
            self.last_line = now
            self.console.print(self.line(), soft_wrap=True, highlight=False)


@contextlib.contextmanager
def progress(console: Console, description: str, total: int, unit: str = "prompts", enabled: bool = True):
    """Yields `advance(tokens=0)`: a rich bar on a terminal, plain lines otherwise, nothing when disabled."""
    if not enabled:
        yield lambda tokens=0: None
        return
    if not console.is_terminal:
        yield PlainProgress(console, description, total, unit).advance
        return
    counted = {"tokens": 0}
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TextColumn("{task.fields[rate]}"), TimeRemainingColumn(), TimeElapsedColumn(),
                  console=console, transient=True) as bar:
        task = bar.add_task(description, total=total, rate="")
        start = time.monotonic()

        def advance(tokens: int = 0) -> None:
            counted["tokens"] += tokens
            rate = counted["tokens"] / max(time.monotonic() - start, 1e-9)
            bar.update(task, advance=1, rate=f"{rate:.0f} tok/s" if counted["tokens"] else "")

        yield advance

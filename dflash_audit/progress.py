"""Progress of long runs on stderr, counted in tokens: a live bar on a terminal, plain lines in a log.

A run is `prompts` prompts, each taken `passes` times (`compare`: the target's cache build, then each
drafter's replay per method; `eval`: once), each pass budgeted `max_new_tokens` tokens. Both views
say the prompts done, the tokens done of the total, tokens per second and the time left; a pass that
stops early (a stop token) gives its unused budget back, so the total is exact once a run ends. Neither
touches a result.
"""

from __future__ import annotations

import contextlib
import time

from rich.console import Console
from rich.progress import (
    BarColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

LOG_EVERY_S = 10.0  # plain lines: at most one per interval, plus the last


def eta_text(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class TokenCount:
    """Tokens done and left of `prompts` x `passes` runs of `budget` tokens each."""

    def __init__(self, prompts: int, budget: int, passes: int = 1, clock=time.monotonic):
        self.prompts, self.passes, self.budget, self.clock = prompts, passes, budget, clock
        self.runs = self.tokens = 0
        self.total = prompts * passes * budget
        self.start = clock()

    def advance(self, tokens: int, budget: int | None = None) -> None:
        """One prompt's pass ended after `tokens` tokens of its `budget` (default: the run's)."""
        self.runs += 1
        self.tokens += tokens
        self.total -= (self.budget if budget is None else budget) - tokens

    def skip(self, runs: int) -> None:
        """`runs` passes that had nothing to do (a cache already built): their budget leaves the total."""
        self.runs += runs
        self.total -= runs * self.budget

    def rate(self) -> float:
        return self.tokens / max(self.clock() - self.start, 1e-9)

    def eta(self) -> float | None:
        return (self.total - self.tokens) / self.rate() if self.tokens else None

    def prompts_text(self) -> str:
        if self.passes == 1:
            return f"{self.runs}/{self.prompts} prompts"
        return f"{self.runs}/{self.prompts * self.passes} prompt passes ({self.prompts} prompts x {self.passes})"

    def line(self) -> str:
        return (f"{self.prompts_text()}, {self.tokens}/{self.total} tokens, {self.rate():.0f} tok/s, "
                f"ETA {eta_text(self.eta())}")

    @property
    def finished(self) -> bool:
        return self.runs >= self.prompts * self.passes


class PlainProgress:
    """A line `description: 3/8 prompts, 190/512 tokens, 412 tok/s, ETA 0:00:12` now and then (a log)."""

    def __init__(self, console: Console, description: str, count: TokenCount):
        self.console, self.description, self.count = console, description, count
        self.last_line = count.start

    def _maybe_print(self) -> None:
        now = self.count.clock()
        if self.count.finished or now - self.last_line >= LOG_EVERY_S:
            self.last_line = now
            self.console.print(f"{self.description}: {self.count.line()}", soft_wrap=True, highlight=False)

    def advance(self, tokens: int, budget: int | None = None) -> None:
        self.count.advance(tokens, budget)
        self._maybe_print()

    def skip(self, runs: int) -> None:
        self.count.skip(runs)
        self._maybe_print()


class BarProgress:
    """The same count on a rich bar (a terminal): tokens completed of the total, prompts, rate, ETA."""

    def __init__(self, bar: Progress, description: str, count: TokenCount):
        self.bar, self.count = bar, count
        self.task = bar.add_task(description, total=count.total, prompts=count.prompts_text(), rate="")

    def _update(self) -> None:
        self.bar.update(self.task, completed=self.count.tokens, total=self.count.total,
                        prompts=self.count.prompts_text(), rate=f"{self.count.rate():.0f} tok/s")

    def advance(self, tokens: int, budget: int | None = None) -> None:
        self.count.advance(tokens, budget)
        self._update()

    def skip(self, runs: int) -> None:
        self.count.skip(runs)
        self._update()


class NoProgress:
    def advance(self, tokens: int, budget: int | None = None) -> None:
        pass

    def skip(self, runs: int) -> None:
        pass


@contextlib.contextmanager
def progress(console: Console, description: str, prompts: int, max_new_tokens: int, passes: int = 1,
             enabled: bool = True):
    """Yields an object with `advance(tokens, budget=None)` per ended pass of a prompt and `skip(runs)`:
    a rich bar on a terminal, plain lines otherwise, nothing when disabled."""
    count = TokenCount(prompts, max_new_tokens, passes)
    if not enabled:
        yield NoProgress()
    elif not console.is_terminal:
        yield PlainProgress(console, description, count)
    else:
        with Progress(TextColumn("{task.description}"), BarColumn(),
                      TextColumn("{task.completed:.0f}/{task.total:.0f} tokens, {task.fields[prompts]}"),
                      TextColumn("{task.fields[rate]}"), TimeRemainingColumn(), TimeElapsedColumn(),
                      console=console, transient=True) as bar:
            yield BarProgress(bar, description, count)

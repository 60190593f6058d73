"""One place for every benchmark's verdict: a ratio (or figure) next to its goal, PASS or FAIL.

Each benchmark prints its rows as `name: value (goal ...) PASS|FAIL` plus one JSON line, and
merges them into `bench/results.json` (the last run of each benchmark); the results
table is generated from that file (`python -m bench.results_table`).
"""

from __future__ import annotations

import json
import os
import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results.json"


@dataclass
class Row:
    name: str  # what is measured, e.g. "static compare, identical pair: ours / floor wall time"
    value: float
    goal: float
    direction: str  # "<=" or ">=": value must be <= or >= goal
    unit: str = "×"
    detail: str = ""  # the figures behind the ratio

    @property
    def passed(self) -> bool:
        return self.value <= self.goal if self.direction == "<=" else self.value >= self.goal

    def line(self) -> str:
        return (f"{self.name}: {self.value:.3g}{self.unit} (goal {self.direction} {self.goal:g}{self.unit}) "
                f"{'PASS' if self.passed else 'FAIL'}" + (f"  [{self.detail}]" if self.detail else ""))


def record(bench: str, command: str, rows: list[Row], extra: dict | None = None, results: Path = RESULTS) -> dict:
    """Print the rows and their JSON line; store them as `bench`'s entry of `results` (bench/results.json)."""
    for row in rows:
        print(row.line())
    entry = {"command": command, "rows": [{**asdict(row), "passed": row.passed} for row in rows],
             "when": time.strftime("%Y-%m-%d %H:%M"), "load_before": round(os.getloadavg()[0], 2),
             "machine": f"{os.cpu_count()} CPUs, {platform.machine()}", **(extra or {})}
    print(json.dumps({"bench": bench, **entry}))
    results = Path(results)
    merged = json.loads(results.read_text()) if results.is_file() else {}
    merged[bench] = entry
    tmp = results.with_name(results.name + ".tmp")
    tmp.write_text(json.dumps(merged, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, results)
    return entry

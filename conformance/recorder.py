"""Collects every comparison of a session and writes `results.json` + `index.html` (atomically)."""

from __future__ import annotations

import json
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from catalogue.pitfalls import PITFALLS as CATALOGUE
from conformance.comparator import REFERENCES_DIFFER, DiffEntry
from foundation.atomic import atomic_write_bytes
from impl.interface_versions import CURRENT as INTERFACE_VERSION

SCHEMA = "dflash-audit-conformance/2"  # /2: `reference-divergence` became `references differ` (README.md)
# When one comparison key sees several outcomes (hypothesis runs many examples), the worst wins. A plug
# mismatch (a call the plug under test cannot take, conformance/plug.py) is worse than a pass and never a fail.
SEVERITY = {"n/a": 0, "pass": 1, REFERENCES_DIFFER: 2, "plug-mismatch": 3, "fail": 4}
# Every catalogue entry the suite checks, with the component name it reports it under.
PITFALLS = {n: p.component for n, p in CATALOGUE.items() if p.checked_by == "conformance"}
# The golden list: every comparison where the two references disagree, with why and where in each.
REFERENCES_DIFFER_LIST = Path(__file__).with_name("references_differ.toml")


def known_differences(path: Path = REFERENCES_DIFFER_LIST) -> list[dict[str, Any]]:
    return tomllib.loads(path.read_text()).get("difference", [])


def identity(row: dict[str, Any]) -> tuple:
    return row["component"], row["pitfall"], row["test"], tuple(row["implementations"])


def golden_changes(components: list[dict[str, Any]], known: list[dict[str, Any]]) -> dict[str, list[dict]]:
    """The references' disagreements against the golden list, either way: `gained` (a disagreement not on the list)
    and `lost` (one on the list whose comparison ran and now agrees). A listed comparison that did not run here (a
    file or `-k` left out) is not judged."""
    listed = {identity(item) for item in known}
    ran = {identity(r): r for r in components if r["comparisons"]}
    gained = [r for key, r in ran.items() if r["status"] == REFERENCES_DIFFER and key not in listed]
    lost = [item for item in known if identity(item) in ran and ran[identity(item)]["status"] != REFERENCES_DIFFER]
    return {"gained": gained, "lost": lost}


@dataclass
class Record:
    component: str
    pitfall: int
    implementations: list[str]
    test: str
    status: str = "n/a"
    comparisons: int = 0
    reason: str = ""
    diff: DiffEntry | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"component": self.component, "pitfall": self.pitfall, "implementations": self.implementations,
                "test": self.test, "status": self.status, "comparisons": self.comparisons, "reason": self.reason,
                "diff": self.diff.to_dict() if self.diff else None}


@dataclass
class Recorder:
    implementation: str = "ours"
    interface_version: int | None = None  # the version the plug under test declares (conformance/plug.py)
    records: dict[tuple, Record] = field(default_factory=dict)
    planted: list[dict[str, Any]] = field(default_factory=list)

    def _record(self, key: dict[str, Any]) -> Record:
        ident = (key["component"], key["pitfall"], tuple(key["implementations"]), key["test"])
        if ident not in self.records:
            self.records[ident] = Record(key["component"], key["pitfall"], list(key["implementations"]), key["test"])
        return self.records[ident]

    def sink(self, status: str, entry: DiffEntry | None, key: dict[str, Any]) -> None:
        record = self._record(key)
        if status == "n/a":
            record.reason = key.get("reason", "")
            return
        record.comparisons += 1
        # The latest failure replaces earlier ones: hypothesis replays its minimal example last.
        if SEVERITY[status] >= SEVERITY[record.status]:
            record.status = status
            if entry is not None:
                record.diff = entry

    def not_applicable(self, component: str, pitfall: int, names: tuple[str, str], test: str, reason: str) -> None:
        record = self._record({"component": component, "pitfall": pitfall, "implementations": list(names),
                               "test": test})
        record.reason = reason

    def add_planted(self, bug: str, component: str, pitfall: int, caught: bool, diff: DiffEntry | None) -> None:
        self.planted = [p for p in self.planted if p["bug"] != bug]
        self.planted.append({"bug": bug, "component": component, "pitfall": pitfall, "caught": caught,
                             "diff_component": diff.component if diff else None,
                             "diff": diff.to_dict() if diff else None})

    # -- pytest-xdist: each worker records its share; the controller merges them and writes once --------
    def export(self) -> dict[str, Any]:
        """What a worker hands the controller: plain JSON types only (execnet carries nothing else)."""
        return json.loads(json.dumps({"records": [r.to_dict() for r in self.records.values()],
                                      "planted": self.planted}, default=str))

    def absorb(self, exported: dict[str, Any]) -> None:
        """Merge a worker's `export()`. Every worker records the same collection-time n/a rows, and a test
        runs on one worker only, so the worst status wins exactly as for one process (`sink`)."""
        for row in exported["records"]:
            record = self._record(row)
            record.comparisons += row["comparisons"]
            record.reason = record.reason or row["reason"]
            if SEVERITY[row["status"]] >= SEVERITY[record.status]:
                record.status = row["status"]
                if row["diff"] is not None:
                    record.diff = DiffEntry.from_dict(row["diff"])
        for bug in exported["planted"]:
            self.planted = [p for p in self.planted if p["bug"] != bug["bug"]] + [bug]

    # -- output --------------------------------------------------------------------------
    def results(self, versions: dict[str, str]) -> dict[str, Any]:
        components = sorted((r.to_dict() for r in self.records.values()),
                            key=lambda r: (r["pitfall"], r["component"], r["test"], r["implementations"]))
        counts = {status: sum(r["status"] == status for r in components) for status in SEVERITY}
        covered = {r["pitfall"] for r in components}
        return {
            "schema": SCHEMA,
            "implementation": self.implementation,
            "summary": {**counts, "pitfalls_covered": sorted(covered),
                        "pitfalls_missing": sorted(set(PITFALLS) - covered),
                        "planted_caught": sum(p["caught"] for p in self.planted), "planted_total": len(self.planted)},
            "pitfalls": {str(n): {"component": name, "status": _worst(r["status"] for r in components
                                                                       if r["pitfall"] == n)}
                         for n, name in PITFALLS.items()},
            "components": components,
            "references_differ": [r for r in components if r["status"] == REFERENCES_DIFFER],
            "references_differ_changes": golden_changes(components, known_differences()),
            "plug_mismatches": [r for r in components if r["status"] == "plug-mismatch"],
            "interface": {"suite": INTERFACE_VERSION, "plug": self.interface_version},
            "planted": sorted(self.planted, key=lambda p: p["bug"]),
            "versions": versions,
        }

    def write(self, out_dir: Path, versions: dict[str, str]) -> dict[str, Any]:
        from conformance.results_page import render

        results = self.results(versions)
        payload = json.dumps(results, indent=2, default=str).encode()
        html = render(results).encode()
        for name, data in (("results.json", payload), ("index.html", html)):
            atomic_write_bytes(out_dir / name, lambda tmp, data=data: Path(tmp).write_bytes(data))
        return results


def _worst(statuses) -> str:
    statuses = list(statuses)
    return max(statuses, key=SEVERITY.__getitem__) if statuses else "missing"

"""Published τ figures (published.json, each with its source) and which cell of a table they sit beside."""

from __future__ import annotations

import json
from pathlib import Path

from foundation.errors import AuditError

PUBLISHED = Path(__file__).with_name("published.json")
LIVE_LIKE = ("live", "zlab-loop", "zlab-benchmark")  # decoding methods; teacher-forced is its own measurement


def load_published() -> dict:
    return json.loads(PUBLISHED.read_text())


def known_targets() -> list[str]:
    return sorted({f["target"] for f in load_published()["figures"]})


def resolve_published(name: str | None, target_dir: Path) -> str | None:
    """The published target whose figures apply: `--published NAME`, else the target directory's name
    when it is one the figures are for (e.g. a local `Qwen3-8B/`)."""
    targets = {t.lower(): t for t in known_targets()}
    if name is not None:
        if name.lower() not in targets:
            raise AuditError(f"--published {name}: no published figures for it; known: {', '.join(targets.values())}")
        return targets[name.lower()]
    return targets.get(Path(target_dir).resolve().name.lower())


def figures_for(target: str | None, set_name: str, decode: str, temperature: float, tau_method: str) -> list[dict]:
    """The published figures beside a cell: same target, set, decoding (dflash/ddtree) and temperature, and a
    measurement of the same kind (decoding methods beside decoding figures, teacher-forced beside teacher-forced)."""
    if target is None:
        return []
    data = load_published()
    kind = "live" if tau_method in LIVE_LIKE else tau_method
    out = []
    for f in data["figures"]:
        f_kind = "live" if f["tau_method"] in LIVE_LIKE else f["tau_method"]
        if (f["target"] == target and f["set"] == set_name and f["method"] == decode
                and float(f["temperature"]) == float(temperature) and f_kind == kind):
            out.append({**f, "source_text": data["sources"][f["source"]]})
    return out

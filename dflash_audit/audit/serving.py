"""Will it serve as trained? A drafter directory loaded by its format's loader (its trained spec, and the
provenance that says which values the file really declares), held against each engine (`serving_engines`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dflash_audit.formats import LoadedCheckpoint, LoadOptions, detect_format, load_any
from serving_engines import ENGINES, TargetFacts
from serving_engines.verdict import (
    EngineReport,
    ServingFinding,
    engine_report,
    trained_values,
)
from foundation.errors import AuditError

__all__ = ["EngineReport", "ServingFinding", "divergence_count", "section_dict", "serving_section"]


def trained_of(loaded: LoadedCheckpoint) -> tuple[dict[str, Any], dict[str, str]]:
    defaulted = {name: p.detail for name, p in loaded.provenance.items() if p.source == "default"}
    values, unknown = trained_values(loaded.spec, loaded.raw.draft_vocab_size, defaulted)
    fc = loaded.state_dict.get("fc.weight")
    if "target_layer_ids" in unknown and fc is not None and fc.ndim == 2 and fc.shape[1] % loaded.spec.hidden_size == 0:
        # ids undeclared, their count is not: fc reads one hidden state per target layer
        values["target_layer_count"] = fc.shape[1] // loaded.spec.hidden_size
    return values, unknown


def not_a_directory(engine: str, path: Path, fmt: str) -> EngineReport:
    message = (f"{engine} serves a drafter directory; {path} is a {fmt} checkpoint file it cannot read: write one "
               f"with `dflash-audit convert --from {path} --to DIR --for {engine}`")
    return EngineReport(engine, "", False, message, {}, {},
                        [ServingFinding("loads", "divergence", None, False, "", message, pitfall=31)], None)


def serving_section(drafter: str | Path, engines: list[str], target: str | Path | None = None,
                    options: LoadOptions | None = None) -> dict[str, EngineReport]:
    """{engine: EngineReport} for one drafter."""
    unknown = sorted(set(engines) - set(ENGINES))
    if unknown:
        raise AuditError(f"unknown engine(s) {unknown}; expected {', '.join(ENGINES)}")
    drafter = Path(drafter)
    fmt = detect_format(drafter)
    if not drafter.is_dir() or fmt not in ("zlab", "speculators"):
        return {engine: not_a_directory(engine, drafter, fmt) for engine in engines}
    loaded = load_any(drafter, target_dir=target, options=options or LoadOptions(flag_prefix=""))
    if loaded.spec is None:
        raise AuditError(f"{drafter}: the drafter's spec is incomplete; give the missing fields with --spec")
    facts = TargetFacts.read(target)
    trained = trained_of(loaded)
    return {engine: engine_report(engine, str(drafter), loaded.spec, facts, trained) for engine in engines}


def section_dict(section: dict[str, EngineReport]) -> dict[str, Any]:
    return {engine: report.to_dict() for engine, report in section.items()}


def divergence_count(section: dict[str, dict[str, Any]]) -> int:
    """Serving divergences in a section as written (`section_dict`, with `--live`'s findings joined): the count
    `serve-check` and `compare --serve` exit 1 on."""
    return sum(f["severity"] == "divergence" for report in section.values() for f in report.get("findings", []))

"""Package versions for the report: the adapters' guard when present, else package metadata."""

from __future__ import annotations

from importlib import metadata

PACKAGES = {"dflash_audit": "dflash-audit", "torch": "torch", "transformers": "transformers",
            "speculators": "speculators", "dflash": "dflash"}


def report_versions() -> dict[str, str | None]:
    try:
        from reference_adapters.versions import versions
    except ImportError:
        return {key: _installed(dist) for key, dist in PACKAGES.items()}
    return dict(versions())


def _installed(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None

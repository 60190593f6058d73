"""The one table of packages whose versions the tool states: in every report (`report.json`,
the conformance results) and in `dflash-audit --version`.

It names the tool, its runtime and every reference, held codebase and serving engine that the
tool holds drafters to; a package listed here appears everywhere at once. `pinned` is the release
an adapter or wrapper is written against (it refuses any other, see reference_adapters/version_guard.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import metadata


@dataclass(frozen=True)
class Package:
    name: str  # the key in reports
    distribution: str  # what pip calls it
    role: str  # tool, runtime, reference, held (a codebase held to the references), engine (serving)
    pinned: str | None = None


PACKAGES = (
    Package("dflash_audit", "dflash-audit", "tool"),
    Package("torch", "torch", "runtime"),
    Package("transformers", "transformers", "runtime"),
    Package("speculators", "speculators", "reference", "0.9.0"),
    Package("dflash", "dflash", "reference", "0.1.0"),
    Package("specforge", "specforge", "held", "0.2.0"),
    Package("modelopt", "nvidia-modelopt", "held", "0.47.0"),
    Package("vllm", "vllm", "engine", "0.33.0"),
    Package("sglang", "sglang", "engine", "0.5.23"),
)
BY_NAME = {package.name: package for package in PACKAGES}
PINNED = {package.name: package.pinned for package in PACKAGES if package.pinned}


def installed_version(distribution: str) -> str | None:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def version_at(distribution: str, site) -> str | None:
    """The version of `distribution` installed in another environment, whose site-packages folder is `site` (the
    vLLM venv's), or None where it is not there once."""
    found = [d for d in metadata.distributions(path=[str(site)])
             if str(d.metadata["Name"] or "").lower() == distribution]
    return found[0].version if len(found) == 1 else None


def installed_versions() -> dict[str, str | None]:
    """`{name: version or None when not installed}` for every package of the table, in its order."""
    return {package.name: installed_version(package.distribution) for package in PACKAGES}

"""Version guard for the two reference packages, and the versions every report records.

The adapters call private functions of `dflash` and `speculators`, so they only hold for
the pinned releases; anything else is refused with the exact commands that fix it.
"""

from __future__ import annotations

from importlib import metadata

from impl.errors import AuditError

PINNED = {"dflash": "0.1.0", "speculators": "0.9.0"}
INSTALL_HINT = {
    "dflash": "pip install dflash==0.1.0",
    # speculators declares heavy CUDA-only dependencies it does not need here.
    "speculators": "pip install --no-deps speculators==0.9.0 "
                   "(then `make setup` for the dependencies it really imports)",
}


def installed_version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def check_reference(package: str) -> str:
    """The installed version of a pinned reference; AuditError with the fix when missing or different."""
    found = installed_version(package)
    wanted = PINNED[package]
    if found == wanted:
        return found
    state = "is not installed" if found is None else f"is {found}, but the adapters are pinned to {wanted}"
    raise AuditError(f"reference package {package} {state}; install the pinned one with: {INSTALL_HINT[package]}")


def check_references() -> dict[str, str]:
    return {package: check_reference(package) for package in PINNED}


def versions() -> dict[str, str | None]:
    """`{"dflash_audit", "torch", "transformers", "speculators", "dflash"}` for report.json."""
    return {name: installed_version(dist) for name, dist in (
        ("dflash_audit", "dflash-audit"), ("torch", "torch"), ("transformers", "transformers"),
        ("speculators", "speculators"), ("dflash", "dflash"))}

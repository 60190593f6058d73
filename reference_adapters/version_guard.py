"""Version guard for the two reference packages.

The adapters call private functions of `dflash` and `speculators`, so they only hold for
the pinned releases (foundation/packages.py); anything else is refused with the exact commands that fix it.
"""

from __future__ import annotations

from foundation.errors import AuditError
from foundation.packages import BY_NAME, PINNED, installed_version

INSTALL_HINT = {
    "dflash": f"pip install dflash=={PINNED['dflash']}",
    # speculators declares heavy CUDA-only dependencies it does not need here.
    "speculators": f"pip install --no-deps speculators=={PINNED['speculators']} "
                   "(then `make setup` for the dependencies it really imports)",
}


def check_reference(package: str) -> str:
    """The installed version of a pinned reference; AuditError with the fix when missing or different."""
    found = installed_version(BY_NAME[package].distribution)
    wanted = PINNED[package]
    if found == wanted:
        return found
    state = "is not installed" if found is None else f"is {found}, but the adapters are pinned to {wanted}"
    raise AuditError(f"reference package {package} {state}; install the pinned one with: {INSTALL_HINT[package]}")

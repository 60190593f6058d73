"""Version guard for the two reference packages, and what those releases cannot run.

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


def refuse_rotary(spec, reference: str, rotate_file: str, note: str = "") -> None:
    """What a reference's model cannot run: both build transformers' `Qwen3RotaryEmbedding` from the layer config
    and rotate with their own `apply_rotary_pos_emb` in `rotate_file` (rotate_half over the whole head).
    `reference`: its name and release, as its n/a reasons begin."""
    from impl.interface import Unsupported  # only here: a guarded import stays as light as the version check

    if spec.partial_rotary_factor != 1.0:
        raise Unsupported(f"{reference} cannot run partial rotary: Qwen3RotaryEmbedding's default rope ignores "
                          f"partial_rotary_factor (all head dims rotated) and {rotate_file} apply_rotary_pos_emb has "
                          f"no pass-through dims{note}")
    if spec.rope_style != "neox":
        raise Unsupported(f"{reference} rotates neox style only ({rotate_file} apply_rotary_pos_emb: rotate_half)")

"""Put first on PYTHONPATH by `dflash-audit trace`: installs the recorder in every Python process of the traced
command before its script runs, then runs the sitecustomize this one shadows, if any."""

import importlib.util
import os
import sys


def _install() -> None:
    """The recorder installed in this process; when it cannot be (this Python lacks torch, the options are not this
    version's), the reason is left for the verb, which says it, and the script runs on unrecorded."""
    try:
        from dflash_audit.trace.record.recorder import install_from_env

        install_from_env()
    except Exception as exc:  # noqa: BLE001 -- whatever it is, the verb names it in its one line
        from dflash_audit.trace.record.marks import Mark, mark

        mark(Mark.INSTALL_FAILED, " ".join(str(exc).split())[:300])


if os.environ.get("DFLASH_AUDIT_TRACE"):
    _install()


def _shadowed() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    for entry in sys.path:
        if os.path.abspath(entry or ".") == here:
            continue
        candidate = os.path.join(entry or ".", "sitecustomize.py")
        if os.path.isfile(candidate):
            spec = importlib.util.spec_from_file_location("_shadowed_sitecustomize", candidate)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            return


_shadowed()

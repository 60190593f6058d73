"""Put first on PYTHONPATH by `dflash-audit trace`: installs the recorder in every Python process of the traced
command before its script runs, then runs the sitecustomize this one shadows, if any."""

import importlib.util
import os
import sys

if os.environ.get("DFLASH_AUDIT_TRACE"):
    from dflash_audit.trace.recorder import install_from_env

    install_from_env()


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

"""The three DFlash implementations behind one interface, by name.

Imports are lazy: the reference packages are heavy and only needed when asked for.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

from impl.errors import AuditError

IMPLEMENTATIONS = {
    "ours": "impl.adapter:OursImplementation",
    "speculators": "reference_adapters.speculators_adapter:SpeculatorsImplementation",
    "zlab": "reference_adapters.zlab_adapter:ZlabImplementation",
}


def get_implementation(name: str, **kwargs: Any):
    """A fresh implementation object (`ours`, `speculators` or `zlab`)."""
    if name not in IMPLEMENTATIONS:
        raise AuditError(f"unknown implementation {name!r}; expected one of {sorted(IMPLEMENTATIONS)}")
    module_name, class_name = IMPLEMENTATIONS[name].split(":")
    return getattr(import_module(module_name), class_name)(**kwargs)

"""The three DFlash implementations behind one interface, by name.

Imports are lazy: the reference packages are heavy and only needed when asked for.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

from foundation.errors import AuditError

# The one registry of implementations by short name (`package.module:object`); the conformance
# suite's `--impl` names are this table plus the held codebases (held/__init__.py).
IMPLEMENTATIONS = {
    "ours": "impl.implementation:OursImplementation",
    "speculators": "reference_adapters.speculators_adapter:SpeculatorsImplementation",
    "zlab": "reference_adapters.zlab_adapter:ZlabImplementation",
}
REFERENCES = ("speculators", "zlab")


def get_implementation(name: str, **kwargs: Any):
    """A fresh implementation object (`ours`, `speculators` or `zlab`)."""
    if name not in IMPLEMENTATIONS:
        raise AuditError(f"unknown implementation {name!r}; expected one of {sorted(IMPLEMENTATIONS)}")
    module_name, class_name = IMPLEMENTATIONS[name].split(":")
    return getattr(import_module(module_name), class_name)(**kwargs)

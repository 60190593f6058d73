"""The three DFlash implementations behind one interface, by name.

Imports are lazy: the reference packages are heavy and only needed when asked for.
"""

from __future__ import annotations

# The one registry of implementations by short name (`package.module:object`); the conformance
# suite's `--impl` names are this table plus the held codebases (held/__init__.py).
IMPLEMENTATIONS = {
    "ours": "impl.implementation:OursImplementation",
    "speculators": "reference_adapters.speculators_adapter:SpeculatorsImplementation",
    "zlab": "reference_adapters.zlab_adapter:ZlabImplementation",
}
REFERENCES = ("speculators", "zlab")



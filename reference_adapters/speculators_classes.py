"""speculators 0.9.0's model and config class of each DFlash family (`speculators_model_type`).

One table for the format reader, the writer and the adapter: speculators' own classes, imported when first
asked for (importing speculators costs seconds that format detection never needs)."""

from __future__ import annotations

from functools import cache

from reference_adapters.version_guard import check_reference


@cache
def _classes() -> dict[str, tuple[type, type]]:
    check_reference("speculators")
    from speculators.models.dflash import DFlashDraftModel, DFlashSpeculatorConfig
    from speculators.models.dflash2 import DFlash2DraftModel, DFlash2SpeculatorConfig
    from speculators.models.dspark import DSparkDraftModel, DSparkSpeculatorConfig
    from speculators.models.xpress import XPressDraftModel, XPressSpeculatorConfig

    return {"dflash": (DFlashDraftModel, DFlashSpeculatorConfig), "dflash2": (DFlash2DraftModel, DFlash2SpeculatorConfig),
            "dspark": (DSparkDraftModel, DSparkSpeculatorConfig), "xpress": (XPressDraftModel, XPressSpeculatorConfig)}


def model_class(family: str) -> type:
    return _classes()[family][0]


def config_class(family: str) -> type:
    return _classes()[family][1]

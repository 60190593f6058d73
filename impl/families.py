"""DFlash or DFlash2: the one place that decides which family a drafter is.

Three things can say it, and each is read by one function here:
- the settings (`spec_family`): DFlash2 is the drafter that carries convolutions (`conv_kernel_size`);
- a config.json (`config_family`): z-lab's `architectures: ["DFlash2DraftModel"]`, or speculators'
  `speculators_model_type: "dflash2"`;
- a body's tensor names (`body_is_dflash2`): a convolution or a selector codebook.
tests/test_restatements.py fails on a second copy of these tests.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

FAMILIES = ("dflash", "dflash2")
ZLAB_ARCHITECTURES = {"dflash": "DFlashDraftModel", "dflash2": "DFlash2DraftModel"}
# Tensors only a DFlash2 body has: layer 0's attention convolution and the selector's codebook.
DFLASH2_MARKERS = ("layers.0.attention_conv.base_kernel", "candidate_selector.predecessor_codebook")


def spec_family(conv_kernel_size: int | None) -> str:
    """The family settings describe: DFlash2 exactly when they carry convolutions."""
    return "dflash2" if conv_kernel_size is not None else "dflash"


def config_family(config: dict[str, Any]) -> str:
    """The family a z-lab or speculators config.json declares (DFlash when it names neither)."""
    architectures = config.get("architectures") or []
    if config.get("speculators_model_type") == "dflash2" or ZLAB_ARCHITECTURES["dflash2"] in architectures:
        return "dflash2"
    return "dflash"


def is_zlab_architecture(config: dict[str, Any]) -> bool:
    """Whether a config.json names one of z-lab's drafter classes."""
    return bool(set(ZLAB_ARCHITECTURES.values()) & set(config.get("architectures") or []))


def body_is_dflash2(names: Iterable[str]) -> bool:
    """Whether a body's tensor names hold any convolution or selector tensor."""
    names = set(names)
    return any(marker in names for marker in DFLASH2_MARKERS) or any("_conv." in name for name in names)

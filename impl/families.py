"""Which family a drafter is: DFlash, DFlash2, DSpark or XPress; the one place that decides it.

Three things can say it, and each is read by one function here:
- the settings (`spec_family`): DFlash2 carries convolutions (`conv_kernel_size`), DSpark its Markov and
  confidence heads' settings (`markov_rank`), XPress its refiner's (`xpress_rank`);
- a config.json (`config_family`): z-lab's `architectures: ["DFlash2DraftModel"]`, or speculators'
  `speculators_model_type` (`dflash2`, `dspark`, `xpress`);
- a body's tensor names (`body_is_dflash2`, `body_family`): a convolution or a selector codebook, a Markov or
  confidence head, a refiner head.
tests/test_restatements.py fails on a second copy of these tests.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

FAMILIES = ("dflash", "dflash2", "dspark", "xpress")
# The families our trainer trains: all four (DSpark's and XPress's heads and losses: impl/family_step.py,
# impl/family_losses.py).
TRAINED_FAMILIES = FAMILIES
# The families `dflash-audit demo` builds its planted-bug story on.
DEMO_FAMILIES = ("dflash", "dflash2")
# The families speculators 0.9.0 writes (`speculators_model_type`); all four are DFlash drafters.
SPECULATORS_TYPES = FAMILIES
# z-lab's dflash 0.1.0 has DFlash and DFlash2 only: no z-lab format exists for DSpark or XPress.
ZLAB_ARCHITECTURES = {"dflash": "DFlashDraftModel", "dflash2": "DFlash2DraftModel"}
TITLES = {"dflash": "DFlash", "dflash2": "DFlash2", "dspark": "DSpark", "xpress": "XPress"}
# Tensors only a DFlash2 body has: layer 0's attention convolution and the selector's codebook.
DFLASH2_MARKERS = ("layers.0.attention_conv.base_kernel", "candidate_selector.predecessor_codebook")
# The head modules of the other two families, as speculators names them (models/dspark, models/xpress).
HEAD_PREFIXES = {"dspark": ("markov_head.", "confidence_head."), "xpress": ("refiner_head.",)}


def spec_family(conv_kernel_size: int | None, markov_rank: int | None = None, xpress_rank: int | None = None) -> str:
    """The family settings describe: DFlash2 with convolutions, DSpark with a Markov rank (0 included: a DSpark
    drafter without the Markov head), XPress with a refiner rank, else DFlash."""
    if conv_kernel_size is not None:
        return "dflash2"
    if markov_rank is not None:
        return "dspark"
    return "xpress" if xpress_rank is not None else "dflash"


def config_family(config: dict[str, Any]) -> str:
    """The family a z-lab or speculators config.json declares (DFlash when it names none)."""
    kind = config.get("speculators_model_type")
    if kind in SPECULATORS_TYPES:
        return kind
    if ZLAB_ARCHITECTURES["dflash2"] in (config.get("architectures") or []):
        return "dflash2"
    return "dflash"


def is_zlab_architecture(config: dict[str, Any]) -> bool:
    """Whether a config.json names one of z-lab's drafter classes."""
    return bool(set(ZLAB_ARCHITECTURES.values()) & set(config.get("architectures") or []))


def body_is_dflash2(names: Iterable[str]) -> bool:
    """Whether a body's tensor names hold any convolution or selector tensor."""
    names = set(names)
    return any(marker in names for marker in DFLASH2_MARKERS) or any("_conv." in name for name in names)


def head_family(name: str) -> str | None:
    """The family whose head a tensor name belongs to (DSpark's Markov/confidence heads, XPress's refiner)."""
    return next((family for family, prefixes in HEAD_PREFIXES.items() if name.startswith(prefixes)), None)

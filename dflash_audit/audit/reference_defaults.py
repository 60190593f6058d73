"""The training recipe a drafter is assumed to follow when its checkpoint carries none.

Read from the installed speculators package (the training reference), never restated:
`DFlashDraftModel.forward`'s defaults (gamma, max_anchors), `compute_metrics`' default
loss config, `DFlashSpeculatorConfig.sample_from_anchor`, and targets from
`verifier_last_hidden_states` (the final decoder layer). Note that speculators' *CLI*
(`TrainConfig`) resolves a dflash run to `ce` + D-PACE weighting instead; the model-level
defaults are the ones every DFlash trainer shares, so they are the yardstick here.
"""

from __future__ import annotations

import inspect
from functools import lru_cache

from impl.spec import Recipe


@lru_cache(maxsize=1)
def reference_recipe() -> tuple[Recipe, dict[str, str]]:
    """speculators' default recipe and, per field, which reference it came from."""
    from speculators.models.dflash import metrics
    from speculators.models.dflash.config import DFlashSpeculatorConfig
    from speculators.models.dflash.core import DFlashDraftModel

    forward = inspect.signature(DFlashDraftModel.forward).parameters
    recipe = Recipe(
        gamma=float(forward["gamma"].default),
        loss_kind=next(iter(metrics._DEFAULT_LOSS_CONFIG)),
        verifier_source_layer=None,  # verifier_last_hidden_states: the final decoder layer
        noise_std=0.0,
        max_anchors=int(forward["max_anchors"].default),
        sample_from_anchor=bool(DFlashSpeculatorConfig.model_fields["sample_from_anchor"].default),
    )
    sources = {
        "gamma": "speculators 0.9.0 DFlashDraftModel.forward(gamma=...) default",
        "loss_kind": "speculators 0.9.0 models/dflash/metrics.py default loss config",
        "verifier_source_layer": "speculators 0.9.0 targets from verifier_last_hidden_states (final layer)",
        "noise_std": "speculators 0.9.0 adds no hidden-state noise by default",
        "max_anchors": "speculators 0.9.0 DFlashDraftModel.forward(max_anchors=...) default",
        "sample_from_anchor": "speculators 0.9.0 DFlashSpeculatorConfig.sample_from_anchor default",
    }
    return recipe, sources

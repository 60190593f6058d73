"""DSpark's and XPress's training forward through speculators' own `DSparkDraftModel.forward` and
`XPressDraftModel.forward`: the knobs resolved by the class's own `get_trainer_kwargs` (eager losses: the fused ones
need Triton), the loss and metrics it returns, and what it hands its `compute_metrics` (the Markov-corrected or
teacher-forced refined logits, the confidence logits, the rounds' and the backbone's logits) read where it hands it.
"""

from __future__ import annotations

from dataclasses import dataclass
from unittest import mock

import torch

from impl.family_losses import FamilyTraining
from impl.recipe import Recipe
from reference_adapters.version_guard import check_reference

check_reference("speculators")

import speculators.models.dspark.core as dspark_core  # noqa: E402
import speculators.models.xpress.core as xpress_core  # noqa: E402

CORES = {"dspark": dspark_core, "xpress": xpress_core}


def trainer_kwargs(model, recipe: Recipe) -> dict:
    """The forward's keyword arguments as speculators' trainer makes them: the recipe in TrainConfig's flat names,
    through the model class's own `get_trainer_kwargs`."""
    flat = {"loss_fn": recipe.loss_fn, "loss_implementation": "eager", "dflash_decay_gamma": recipe.gamma,
            "max_anchors": recipe.max_anchors, "per_position_loss_weight": recipe.per_position_loss_weight,
            "dpace_alpha": recipe.dpace_alpha, "confidence_head_alpha": recipe.confidence_head_alpha,
            "consistency_weight": recipe.consistency_weight, "consistency_passes": recipe.consistency_passes,
            "base_anchor_weight": recipe.base_anchor_weight, "base_anchor_full_weight": recipe.base_anchor_full_weight,
            "ce_from_data": recipe.ce_from_data}
    kwargs, _ = type(model).get_trainer_kwargs(**flat)
    return kwargs


@dataclass
class FamilyForward:
    loss: torch.Tensor
    metrics: dict
    backbone: tuple  # _backbone_forward's (hidden, logits, targets, aligned mask, block indices)
    handed: tuple  # compute_metrics' positional arguments
    handed_kwargs: dict

    def terms(self) -> dict[str, torch.Tensor]:
        """Every loss term under its metric name (`<name>_sum` of a `*loss`), the total under "loss"."""
        terms = {name[: -len("_sum")]: value for name, value in self.metrics.items()
                 if name.endswith("_sum") and name[: -len("_sum")].endswith("loss")}
        return {**terms, "loss": self.loss}

    def training(self, family: str) -> tuple[torch.Tensor, FamilyTraining]:
        """(the logits the family trains, what its heads add)."""
        if family == "dspark":
            logits, _, confidence = self.handed[:3]
            return logits, FamilyTraining(confidence_logits=confidence)
        refined, rounds, base = self.handed[:3]
        return refined, FamilyTraining(round_logits=list(rounds), base_logits=base,
                                       data_labels=self.handed_kwargs.get("data_labels"))


def family_forward(model, family: str, states, input_ids, loss_mask, document_ids, kwargs: dict) -> FamilyForward:
    """The model's own forward on the target's states, read at its backbone and at its `compute_metrics`."""
    core, captured = CORES[family], {}
    backbone, metrics = model._backbone_forward, core.compute_metrics

    def keep_backbone(*args, **kw):
        captured["backbone"] = backbone(*args, **kw)
        return captured["backbone"]

    def keep_metrics(*args, **kw):
        captured["handed"], captured["kwargs"] = args, kw
        return metrics(*args, **kw)

    with mock.patch.object(model, "_backbone_forward", keep_backbone), \
            mock.patch.object(core, "compute_metrics", keep_metrics):
        _, loss, out = model(states.context, input_ids, loss_mask, states.final_raw, document_ids, **kwargs)
    return FamilyForward(loss, out, captured["backbone"], captured["handed"], captured["kwargs"])

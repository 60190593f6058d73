"""One `train` run's settings (`RunSettings`): data, schedule and bookkeeping, every drafter setting `train` takes and
every recipe knob, each a declared pydantic field. Light on purpose: `dflash-audit train` builds its options from
these declarations and refuses a bad value before the trainer (torch, the target) is imported."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import AfterValidator, ConfigDict, Field, model_validator
from pydantic.fields import FieldInfo

from impl.recipe import KNOBS, LossWeighting
from impl.families import TITLES, TRAINED_FAMILIES
from impl.settings import STRICT, Declared
from impl.spec import SETTINGS, MarkovHeadType, SpecError
from impl.spec import TRAIN_DEFAULTS as SPEC_TRAIN_DEFAULTS


class TrainError(ValueError):
    """A training run that cannot start as asked; one line."""


class SettingRefused(TrainError, SpecError):
    """A run setting refused against the target or the recipe: a `TrainError` naming its setting (`field`), which
    `train` words under the setting's flag."""

    @classmethod
    def of(cls, exc: SpecError) -> SettingRefused:
        return cls(exc.field, str(exc).removeprefix(f"{exc.field}: "))


def spec_setting(name: str) -> Any:
    """A drafter setting `train` takes, as a run field: its declaration in impl/spec.py (kind, bounds, description),
    at `train`'s default (None: the one its declaration names, e.g. z-lab's target layers)."""
    return FieldInfo.merge_field_infos(SETTINGS[name], default=SPEC_TRAIN_DEFAULTS[name], json_schema_extra=None)


def recipe_knob(name: str) -> Any:
    """A recipe knob as a run field: its declaration in impl/recipe.py (kind, bounds, description), None when not
    given (the run family's `train` default, `train_defaults`). A rule between knobs is the recipe's own, judged when
    the run starts (`knob_recipe`)."""
    merged = FieldInfo.merge_field_infos(KNOBS[name], default=None, json_schema_extra=None)
    # The knob's own validators (a loss spec's spelling) judge a given value; None is "not given".
    merged.metadata = [AfterValidator(given_only(m.func)) if isinstance(m, AfterValidator) else m
                       for m in merged.metadata]
    return merged


def given_only(check: Any) -> Any:
    return lambda value: value if value is None else check(value)


class RunSettings(Declared):
    """One `train` run's settings: data, schedule and bookkeeping, every drafter setting `train` takes (impl/spec.py)
    and every recipe knob (impl/recipe.py), each validated by pydantic. (Not speculators' `TrainConfig`, whose
    resolution `--recipe speculators` reads.) tests/test_recipe_knobs.py holds its setting and knob fields to their
    declarations: one each, of the declared kind, at `train`'s default."""

    SUBJECT = "run settings"
    INTEGER_WORDS = True
    model_config = ConfigDict(**STRICT, allow_inf_nan=False)  # a NaN learning rate or an infinite gamma is a typo

    target: str
    out: str
    data: str | None = None  # JSON-lines file ...
    records: list[dict[str, Any]] | None = None  # ... or the same records in memory
    eval_data: str | None = None  # held-out file; else the last `eval_sequences` packed rows
    eval_sequences: int = Field(2, ge=0, description="Rows held out when no --eval-data is given.")
    steps: int = Field(1000, gt=0, description="Optimizer steps.")
    # > 0: torch's own "Invalid learning rate" would name no setting
    lr: float = Field(6e-4, gt=0, description="Peak learning rate (AdamW's; Muon's too unless --muon-lr).")
    warmup: int | None = Field(50, ge=0, description="Linear warmup steps before the decay (none given with "
                               "--recipe speculators: steps // 100, speculators' rule).")
    weight_decay: float = Field(0.01, ge=0, description="AdamW's weight decay.")
    grad_clip: float = Field(1.0, gt=0, description="The gradient's norm is clipped to this.")
    # The optimizers and schedule (`--recipe speculators`: Muon + AdamW, linear; speculators_run_recipe.py).
    optimizer: Literal["adamw", "muon"] = Field("adamw", description="adamw: AdamW on every parameter; muon: Muon on "
                                                "the 2-D weight matrices and AdamW on the rest, as speculators trains.")
    lr_schedule: Literal["cosine", "linear"] = Field("cosine", description="cosine: warmup (k + 1)/warmup, then "
                                                     "cosine decay to 0.1 of the peak; linear: warmup k/warmup, then "
                                                     "linear decay to 0 (transformers' get_linear_schedule_with_warmup).")
    adam_betas: tuple[float, float] = Field((0.9, 0.95), description="AdamW's betas.")
    muon_lr: float | None = Field(None, gt=0, description="Muon's lr (default: --lr).")
    muon_momentum: float = Field(0.95, ge=0, lt=1, description="Muon's momentum.")
    muon_weight_decay: float = Field(0.1, ge=0, description="Muon's weight decay.")
    muon_adjust_lr_fn: Literal["original", "match_rms_adamw"] = Field(
        "match_rms_adamw", description="Muon's lr adjustment to the matrix shape.")
    batch_size: int = Field(4, gt=0, description="Packed rows per micro-batch, across all ranks.")
    grad_accum: int = Field(1, gt=0, description="Micro-batches per optimizer step.")
    seq_len: int = Field(1024, gt=0, description="Packed row length.")
    # A reduced draft vocabulary (`draft_vocab_size` below) is the N most frequent loss-masked tokens of the training
    # data (impl.vocab_mapping), or the map in `d2t` (a .npy of offsets, as speculators writes d2t-N.npy).
    d2t: str | None = None
    family: Literal[TRAINED_FAMILIES] = Field("dflash", description="dflash; dflash2 (convolutions + candidate selector); dspark (Markov "
                        "and confidence heads); xpress (causal refiner). Each trains with its loss and its defaults as "
                        "speculators' trainer resolves the family.")
    dtype: Literal["fp32", "bf16"] = Field("fp32", description="fp32, or bf16 (autocast, fp32 master weights).")
    eval_every: int = Field(0, ge=0, description="Evaluate every N steps (0: at the end only).")
    save_every: int = Field(0, ge=0, description="Checkpoint every N steps (0: at the end only).")
    resume: bool = Field(False, description="Continue the run saved at --out.")
    seed: int = 0
    max_seconds: float | None = Field(None, gt=0, description="Shrink the schedule to fit this wall-clock budget.")
    stop_at: int | None = None  # leave after this step with a checkpoint, schedule unchanged (preemption)
    progress: bool = True
    extra: dict[str, Any] = Field(default_factory=dict)

    # The drafter settings `train` takes, under their run names.
    draft_layers: int = spec_setting("num_hidden_layers")
    target_layer_ids: tuple[int, ...] | None = spec_setting("target_layer_ids")
    mask_token_id: int | None = spec_setting("mask_token_id")
    block_size: int = spec_setting("block_size")
    layer_types: tuple[str, ...] | None = spec_setting("layer_types")
    sliding_window: int | None = spec_setting("sliding_window")
    sliding_window_non_causal: bool | None = spec_setting("sliding_window_non_causal")  # None: the family's
    conv_kernel_size: int | None = spec_setting("conv_kernel_size")
    conv_group_size: int | None = spec_setting("conv_group_size")
    selector_rank: int | None = spec_setting("selector_rank")
    selector_top_k: int | None = spec_setting("selector_top_k")
    draft_vocab_size: int | None = spec_setting("draft_vocab_size")
    markov_rank: int | None = spec_setting("markov_rank")
    markov_head_type: MarkovHeadType | None = spec_setting("markov_head_type")
    enable_confidence_head: bool | None = spec_setting("enable_confidence_head")
    confidence_head_with_markov: bool | None = spec_setting("confidence_head_with_markov")
    xpress_rank: int | None = spec_setting("xpress_rank")
    xpress_mlp_ratio: int | None = spec_setting("xpress_mlp_ratio")
    num_jacobi_passes: int | None = spec_setting("num_jacobi_passes")

    # The recipe knobs (None: not given).
    gamma: float | None = recipe_knob("gamma")
    loss_fn: str | None = recipe_knob("loss_fn")
    verifier_source_layer: int | None = recipe_knob("verifier_source_layer")
    noise_std: float | None = recipe_knob("noise_std")
    max_anchors: int | None = recipe_knob("max_anchors")
    sample_from_anchor: bool | None = recipe_knob("sample_from_anchor")
    per_position_loss_weight: LossWeighting | None = recipe_knob("per_position_loss_weight")
    dpace_alpha: float | None = recipe_knob("dpace_alpha")
    selector_loss_alpha: float | None = recipe_knob("selector_loss_alpha")
    confidence_head_alpha: float | None = recipe_knob("confidence_head_alpha")
    consistency_weight: float | None = recipe_knob("consistency_weight")
    consistency_passes: int | None = recipe_knob("consistency_passes")
    base_anchor_weight: float | None = recipe_knob("base_anchor_weight")
    base_anchor_full_weight: bool | None = recipe_knob("base_anchor_full_weight")
    ce_from_data: bool | None = recipe_knob("ce_from_data")

    @model_validator(mode="after")
    def _rules(self) -> RunSettings:
        """The rules between the run's settings, each naming the setting it refuses."""
        if self.seq_len <= self.block_size:
            raise SpecError("seq_len", f"{self.seq_len} leaves no room for a block of {self.block_size}")
        if self.draft_vocab_size is not None and self.family != "dflash":
            raise SpecError("draft_vocab_size", f"a reduced draft vocabulary needs --family dflash: "
                            f"{TITLES.get(self.family, self.family)} drafts over the full target vocabulary here "
                            "(speculators' DFlash2DraftModel refuses a reduced one; our DSpark and XPress drafters "
                            "have the full vocabulary only)")
        return self

    @classmethod
    def refused(cls, name: str | None, message: str) -> Exception:
        return TrainError(f"{name or cls.SUBJECT}: {message}")

"""How speculators' trainer runs a training, read from the installed package, never restated: the optimizers, the
learning-rate schedule, clipping, accumulation and precision `speculators train --speculator-type <family>` resolves.

Each value comes with the file and line it was read from (`sources`):
- the optimizer settings are `TrainConfig(speculator_type=family).optimizer` after `_resolve_derived_defaults`
  (`OptimizerArgs` in speculators/train/config/schema.py: Muon on the 2-D weight matrices, AdamW on the rest);
- the parameter split is `split_named_params_for_muon` and what `build_optimizers` passes (speculators/train/
  optimizers.py); the settings it does not pass are torch's defaults (`torch.optim.AdamW`, `torch.optim.Muon`);
- the schedule is `SchedulerArgs` (linear) with `_resolve_scheduler_steps`' warmup rule (total // 100) and
  transformers' `get_linear_schedule_with_warmup` (speculators/train/trainer.py);
- clipping, the backwards per optimizer step and the autocast are read from `Trainer.train_epoch`'s own code (its
  `clip_grad_norm_` call and literal, its one `loss.backward()`, its `torch.autocast`), the master weights' dtype
  from `DataArgs.hidden_states_dtype`'s declaration.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

from foundation.packages import installed_version


def _where(obj) -> tuple[str, int, str]:
    """(file relative to site-packages, first line, source) of a function or class."""
    path = Path(inspect.getsourcefile(obj))
    lines, first = inspect.getsourcelines(obj)
    parts = path.parts
    top = next(i for i, part in enumerate(parts) if part in ("speculators", "torch", "transformers"))
    return "/".join(parts[top:]), first, textwrap.dedent("".join(lines))


def _line_of(obj, needle: str) -> str:
    """`file:line` of the first line of `obj`'s source holding `needle`."""
    file, first, source = _where(obj)
    for offset, line in enumerate(source.splitlines()):
        if needle in line:
            return f"{file}:{first + offset}"
    raise LookupError(f"{needle!r} not in {file} (speculators changed; this reader needs a look)")


def _calls(obj, name: str) -> list[tuple[ast.Call, str]]:
    """Every call of `name` (a function or method name) in `obj`'s source, with its `file:line`."""
    file, first, source = _where(obj)
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call):
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if called == name:
                found.append((node, f"{file}:{first + node.lineno - 1}"))
    return found


def _default(callable_, name: str) -> Any:
    return inspect.signature(callable_).parameters[name].default


@dataclass(frozen=True)
class RunReference:
    """The training run `speculators train --speculator-type <family>` resolves, with where each value was read."""

    family: str
    optimizer: str  # "muon": Muon on the 2-D weight matrices + AdamW on the rest; "adamw": AdamW on everything
    muon: dict[str, Any]  # lr, momentum, weight_decay, ns_steps, adjust_lr_fn, nesterov, eps
    adamw: dict[str, Any]  # lr, weight_decay, betas, eps
    adamw_name_hints: tuple[str, ...]  # 2-D parameters whose name holds one of these go to AdamW
    schedule: str  # "linear" | "cosine" | "none"
    warmup_divisor: int | None  # warmup = total // divisor when neither warmup steps nor ratio is given
    warmup_steps: int | None
    warmup_ratio: float | None
    clip_max_norm: float
    clip_norm_type: float
    backwards_per_step: int
    autocast_dtype: str
    master_dtype: str
    sources: dict[str, str] = field(default_factory=dict)

    @property
    def title(self) -> str:
        return reference_title(self.family)

    def group_of(self, name: str, shape: list[int]) -> str:
        """Which of the reference's optimizers trains a parameter of this name and shape (split_named_params_for_muon)."""
        if self.optimizer != "muon":
            return "adamw"
        matrix = len(shape) == 2 and min(shape) > 1 and not any(hint in name for hint in self.adamw_name_hints)
        return "muon" if matrix else "adamw"

    def settings_text(self, which: str) -> str:
        values = self.muon if which == "muon" else self.adamw
        return ", ".join(f"{k} {v}" for k, v in values.items())

    def warmup_for(self, total: int) -> int:
        """The reference's warmup for a schedule of `total` steps (`_resolve_scheduler_steps`)."""
        if self.warmup_steps is not None:
            return self.warmup_steps
        if self.warmup_ratio is not None:
            return int(total * self.warmup_ratio)
        return total // (self.warmup_divisor or 1)


def reference_title(family: str) -> str:
    """What the run is held to, named without importing speculators (a one-step trace needs no more of it)."""
    return f"speculators {installed_version('speculators')} TrainConfig-resolved {family} run"


@lru_cache(maxsize=8)
def run_reference(family: str = "dflash") -> RunReference:
    import speculators.models.dflash  # noqa: F401  (registers the DFlash family)
    import torch
    from speculators.train import optimizers as spec_optimizers
    from speculators.train import trainer as spec_trainer
    from speculators.train.config import schema
    from transformers import optimization

    TrainConfig = schema.TrainConfig  # noqa: N806
    config = TrainConfig(speculator_type=family)  # every other field at its default, then resolved
    opt, sched = config.optimizer, config.scheduler
    sources = {}
    for name in ("optimizer", "lr", "weight_decay", "muon_lr", "muon_momentum", "muon_weight_decay", "muon_ns_steps",
                 "muon_adjust_lr_fn"):
        sources[name] = _line_of(schema.OptimizerArgs, f"{name}:")
    sources["muon_lr"] += f" (unset: {_line_of(TrainConfig._resolve_derived_defaults, 'muon_lr = ')})"
    for name in ("scheduler_type", "scheduler_warmup_steps", "scheduler_warmup_ratio"):
        sources[name] = _line_of(schema.SchedulerArgs, f"{name}:")
    adamw_defaults = {"betas": tuple(_default(torch.optim.AdamW, "betas")), "eps": _default(torch.optim.AdamW, "eps")}
    muon_defaults = {"nesterov": _default(torch.optim.Muon, "nesterov"), "eps": _default(torch.optim.Muon, "eps")}
    sources["adamw_defaults"] = f"{_where(torch.optim.AdamW.__init__)[0]}:{_where(torch.optim.AdamW.__init__)[1]} " \
                                "(betas, eps: torch's defaults; build_optimizers passes only lr and weight_decay)"
    sources["muon_defaults"] = f"{_where(torch.optim.Muon.__init__)[0]}:{_where(torch.optim.Muon.__init__)[1]} " \
                               "(nesterov, eps: torch's defaults)"
    sources["split"] = _line_of(spec_optimizers.split_named_params_for_muon, "param.ndim == _MATRIX_NDIM")
    sources["build_optimizers"] = _line_of(spec_optimizers.build_optimizers, "torch.optim.Muon(")
    # The warmup rule: the floor division by a literal in `_resolve_scheduler_steps` (1% of the total).
    divisor, divisor_line = None, ""
    file, first, source = _where(spec_trainer._resolve_scheduler_steps)
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.FloorDiv) and isinstance(node.right, ast.Constant):
            divisor, divisor_line = int(node.right.value), f"{file}:{first + node.lineno - 1}"
    sources["warmup"] = divisor_line
    sources["schedule"] = _line_of(spec_trainer.Trainer.setup_optimizer, "get_linear_schedule_with_warmup(") + \
        " -> " + _line_of(optimization._get_linear_schedule_with_warmup_lr_lambda, "if current_step")
    # Clipping: the trainer's own call and its literal max norm.
    clips = _calls(spec_trainer.Trainer.train_epoch, "clip_grad_norm_")
    if len(clips) != 1 or len(clips[0][0].args) < 2 or not isinstance(clips[0][0].args[1], ast.Constant):
        raise LookupError("speculators' Trainer.train_epoch no longer clips with one literal clip_grad_norm_ call")
    clip_call, sources["clip"] = clips[0]
    norm_type = next((kw.value.value for kw in clip_call.keywords if kw.arg == "norm_type"), 2.0)
    backwards = _calls(spec_trainer.Trainer.train_epoch, "backward")
    sources["backwards"] = ", ".join(where for _, where in backwards) + " (one backward per optimizer step)"
    autocasts = _calls(spec_trainer.Trainer.train_epoch, "autocast")
    sources["autocast"] = autocasts[0][1] if autocasts else ""
    sources["hidden_states_dtype"] = _line_of(schema.DataArgs, "hidden_states_dtype:")
    muon = {"lr": opt.muon_lr, "momentum": opt.muon_momentum, "weight_decay": opt.muon_weight_decay,
            "ns_steps": opt.muon_ns_steps, "adjust_lr_fn": opt.muon_adjust_lr_fn, **muon_defaults}
    adamw = {"lr": opt.lr, "weight_decay": opt.weight_decay, **adamw_defaults}
    return RunReference(
        family=family, optimizer=opt.optimizer, muon=muon, adamw=adamw,
        adamw_name_hints=tuple(spec_optimizers._ADAMW_NAME_HINTS), schedule=sched.scheduler_type,
        warmup_divisor=divisor, warmup_steps=sched.scheduler_warmup_steps, warmup_ratio=sched.scheduler_warmup_ratio,
        clip_max_norm=float(clip_call.args[1].value), clip_norm_type=float(norm_type),
        backwards_per_step=len(backwards), autocast_dtype=config.data.hidden_states_dtype, master_dtype="float32",
        sources=sources)


def train_run_settings(family: str = "dflash") -> dict[str, Any]:
    """The resolved run as `impl.run_settings.RunSettings` fields (`train --recipe speculators`): its optimizers, their
    settings, the linear schedule with speculators' warmup rule (warmup None: steps // 100) and its clipping."""
    ref = run_reference(family)
    if ref.warmup_steps is not None or ref.warmup_ratio is not None or ref.warmup_divisor != 100:
        raise ValueError(f"speculators' {family} run warms up otherwise than steps // 100; our trainer does not")
    return {"optimizer": ref.optimizer, "lr_schedule": ref.schedule, "lr": ref.adamw["lr"],
            "weight_decay": ref.adamw["weight_decay"], "adam_betas": tuple(ref.adamw["betas"]),
            "muon_lr": ref.muon["lr"], "muon_momentum": ref.muon["momentum"],
            "muon_weight_decay": ref.muon["weight_decay"], "muon_adjust_lr_fn": ref.muon["adjust_lr_fn"],
            "warmup": None, "grad_clip": ref.clip_max_norm}


def reference_loss_kwargs(model_class, family: str, loss_fn: str, implementation: str, max_anchors: int) -> dict:
    """The loss keywords speculators' trainer passes its model's forward (`get_trainer_kwargs`, as train/cli.py calls
    it) for a `speculators train --speculator-type <family> --loss-fn <loss_fn>` run, every other flag at its
    default and resolved (`TrainConfig._resolve_derived_defaults`): D-PACE weighting for DFlash under CE, which it
    refuses under any other loss (`_validate_dpace`), so a KL run is the fixed exponential decay. `max_anchors` is the
    batch's (a shape of the data, not of the loss); `implementation` the team's kernel (eager or fused)."""
    from speculators.train.config import schema

    weight = None
    for _ in range(2):
        try:
            config = schema.TrainConfig(speculator_type=family, loss={"loss_fn": loss_fn,
                                                                      "loss_implementation": implementation},
                                        dflash={"per_position_loss_weight": weight} if weight else {})
            break
        except ValueError:  # D-PACE needs CE: speculators' user of another loss sets the fixed decay
            weight = "fixed-exp-decay"
    flat = {"loss_fn": config.loss.loss_fn, "loss_implementation": config.loss.loss_implementation,
            "dflash_decay_gamma": config.dflash.dflash_decay_gamma, "max_anchors": max_anchors,
            "per_position_loss_weight": config.dflash.per_position_loss_weight,
            "dpace_alpha": config.dflash.dpace_alpha}
    train_kwargs, _ = model_class.get_trainer_kwargs(**flat)
    return train_kwargs

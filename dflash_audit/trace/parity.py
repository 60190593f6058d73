"""Step parity (`trace --steps N --parity K`): speculators' own optimizer step run beside the team's recorded run.

The recorder kept, for each of the first K + 1 steps, the drafter's trainable weights as the step began, the gradient
after the step's last backward and the gradient its optimizer stepped (run_record.py). Here a module of the same
parameter names is given speculators' resolved optimizers (`speculators.train.optimizers.build_optimizers` with the
TrainConfig-resolved settings, as its cli.py builds them) and, for each step k, starting from the team's weights of
that step: the gradient after backward is clipped as speculators' trainer clips it (`clip_grad_norm_`, 1.0), the lr
is speculators' linear schedule over the run's total (lr_fit), and its optimizers step. The first step where the two
part is localized:
- **gradient**: the gradient the team's optimizer stepped is not the reference's clipped gradient (no clipping,
  another max norm, gradients zeroed or changed between backward and step);
- **update**: the same gradient, other weights after the step (another optimizer, lr, schedule or setting).
The forward and the loss of each step are the step audit's (audit.py recomputes each step's loss from its rows and
names every input by value); a step whose forward or loss parts is reported there, per step.

Tolerance. Per-step losses are held, as torchtitan's loss_compare.py and Megatron's golden values hold them, to 1e-5
relative in float32 on a CPU; here gradients in float32 are held to 1e-5 of their norm, and an AdamW update to 1e-5
of its size. Muon's Newton–Schulz iterations run in bfloat16 (torch/optim/_muon.py, `grad.bfloat16()`): its
orthogonalized update carries bfloat16's 8-bit significand, a relative rounding of 2^-8 (3.9e-3) per element at each
of its 5 iterations, so two implementations of the same Muon step agree only to that resolution: a Muon update is
held to 2e-2 of its size (about five bfloat16 roundings). The same torch Muon on the same CPU gives the same bits.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import torch
from torch import nn

FLOAT32_RELATIVE = 1e-5
MUON_RELATIVE = 2e-2  # five bfloat16 roundings (2^-8 each) of the orthogonalized update


def _module_of(params: dict[str, torch.Tensor]) -> nn.Module:
    """A module whose named_parameters() are these names (speculators splits its optimizers by name)."""
    root = nn.Module()
    for name, value in params.items():
        *path, leaf = name.split(".")
        module = root
        for part in path:
            if not hasattr(module, part):
                module.add_module(part, nn.Module())
            module = getattr(module, part)
        module.register_parameter(leaf, nn.Parameter(value.detach().clone().float()))
    return root


def _relative(a: torch.Tensor, b: torch.Tensor, scale: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / scale.double().norm().clamp_min(1e-30))


def step_parity(folder: Path, run_facts: dict, ref, schedule: dict | None) -> dict:
    """The first step and phase where the team's run and speculators' reference step part (None: they do not over
    the steps compared), with the tolerances used."""
    from safetensors.torch import load_file
    from speculators.train.optimizers import build_optimizers
    from transformers.optimization import _get_linear_schedule_with_warmup_lr_lambda as linear

    parity = run_facts.get("parity") or {}
    path = Path(folder) / str(parity.get("file", ""))
    if not parity or not path.is_file():
        return {}
    tensors = load_file(path)
    steps = []
    for k in range(int(parity["steps"])):
        kinds = {"param": {}, "grad": {}, "raw": {}}
        for key, value in tensors.items():
            head, kind, name = key.split("/", 2)
            if head == f"step{k}":
                kinds[kind][name] = value
        steps.append(kinds)
    if len(steps) < 2:
        return {"compared": 0, "parted": None, "note": "one step kept: a step's update needs the next's weights"}
    model = _module_of(steps[0]["param"])
    named = dict(model.named_parameters())
    config = SimpleNamespace(optimizer=ref.optimizer, lr=ref.adamw["lr"], weight_decay=ref.adamw["weight_decay"],
                             muon_lr=ref.muon["lr"], muon_momentum=ref.muon["momentum"],
                             muon_weight_decay=ref.muon["weight_decay"], muon_ns_steps=ref.muon["ns_steps"],
                             muon_adjust_lr_fn=ref.muon["adjust_lr_fn"])
    optimizers = build_optimizers(model, config)
    muon = {id(p) for o in optimizers if type(o).__name__ == "Muon" for g in o.param_groups for p in g["params"]}
    bases = [[g["lr"] for g in o.param_groups] for o in optimizers]
    total = (schedule or {}).get("total")
    first = int(((run_facts.get("steps") or [{}])[0].get("schedulers") or [{}])[0].get("last_epoch", 0) or 0)
    result = {"compared": len(steps) - 1, "parted": None, "optimizers": [type(o).__name__ for o in optimizers],
              "tolerance": {"gradient": FLOAT32_RELATIVE, "adamw_update": FLOAT32_RELATIVE,
                            "muon_update": MUON_RELATIVE},
              "schedule": f"speculators' linear schedule over {total} steps" if total else
                          "the run's own lr factors (its total is not known), at speculators' base lr"}
    lrs = [s["lrs"] for s in run_facts.get("steps", [])]
    for k in range(len(steps) - 1):
        now, after = steps[k], steps[k + 1]
        with torch.no_grad():
            for name, p in named.items():
                p.copy_(now["param"][name])
                raw = now["raw"].get(name)
                p.grad = raw.clone().float() if raw is not None else None
        torch.nn.utils.clip_grad_norm_(model.parameters(), ref.clip_max_norm, ref.clip_norm_type)
        for name, p in named.items():
            team = now["grad"].get(name)
            if p.grad is None or team is None:
                if (p.grad is None) != (team is None):
                    result["parted"] = {"step": k + 1, "phase": "gradient", "parameter": name,
                                        "what": "a gradient on one side only"}
                    return result
                continue
            difference = _relative(team, p.grad, p.grad)
            if difference > FLOAT32_RELATIVE:
                result["parted"] = {"step": k + 1, "phase": "gradient", "parameter": name, "difference": difference,
                                    "tolerance": FLOAT32_RELATIVE,
                                    "what": f"the gradient stepped has norm {float(team.norm()):.4g}, the reference's "
                                            f"clipped one {float(p.grad.norm()):.4g}"}
                return result
        if total:
            factor = linear(first + k, num_warmup_steps=ref.warmup_for(total), num_training_steps=total)
        else:  # the team's own factor, read off its first group's lr
            team_lr, team_base = lrs[k][0][0], (run_facts["steps"][0]["initial_lrs"][0][0] or lrs[0][0][0])
            factor = team_lr / team_base if team_base else 0.0
        for o, base in zip(optimizers, bases):
            for group, lr in zip(o.param_groups, base):
                group["lr"] = lr * factor
            o.step()
        for name, p in named.items():
            step_size = p.detach() - now["param"][name].float()
            tolerance = MUON_RELATIVE if id(p) in muon else FLOAT32_RELATIVE
            if float(step_size.norm()) == 0.0 and float((after["param"][name].float() - p.detach()).norm()) == 0.0:
                continue
            difference = _relative(after["param"][name].float(), p.detach(),
                                   step_size if float(step_size.norm()) > 0 else p.detach())
            if difference > tolerance:
                result["parted"] = {"step": k + 1, "phase": "update", "parameter": name, "difference": difference,
                                    "tolerance": tolerance,
                                    "what": f"after the step the weights differ by {difference:.3g} of the "
                                            f"reference's update ({'Muon' if id(p) in muon else 'AdamW'})"}
                return result
    return result

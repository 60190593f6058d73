"""Step parity (`trace --parity K`): speculators' own training step run beside the team's recorded run, K steps.

The recorder kept, for each of the first K + 1 steps, the drafter's trainable weights as the step began, the gradient
after the step's last backward and the gradient its optimizer stepped (run/recorder.py), and, when the drafter is one
of speculators' model classes, the step's batch as its forward took it, the random state its anchors were drawn
from, its draft logits and its loss (run/parity_capture.py). For each step k, from the team's weights of that step:
- **forward**: speculators' own model class (built from the drafter's config, its untrained weights and the step's
  trained ones) runs the batch from the same random state: its draft logits are the team's;
- **loss**: its loss, with the loss keywords speculators' trainer passes (`get_trainer_kwargs` on the
  TrainConfig-resolved run for the team's loss kind, reference_adapters/speculators_run_recipe.py), is the loss the
  team's forward returned;
- **gradient**: the reference loss's gradient is the team's after backward (a step of one backward), and that
  gradient clipped as speculators' trainer clips it (`clip_grad_norm_`, 1.0) is the one the team's optimizer stepped
  (no clipping, another max norm, gradients zeroed or changed between backward and step);
- **update**: speculators' resolved optimizers (`speculators.train.optimizers.build_optimizers`, as its cli.py builds
  them) at speculators' linear schedule over the run's total (lr_fit) step to the team's next weights.
The first step and phase where the two part is reported. A drafter that is not speculators' model has no forward of
speculators' to run beside it: its forward and loss are not compared here (the step audit recomputes each step's
loss from its rows and names its inputs), and the result says so.

Tolerance. Per-step losses are held, as torchtitan's loss_compare.py and Megatron's golden values hold them, to 1e-5
relative in float32 on a CPU; the draft logits and the gradients in float32 to 1e-5 of their norm, and an AdamW
update to 1e-5 of its size. Muon's Newton–Schulz iterations run in bfloat16 (torch/optim/_muon.py, `grad.bfloat16()`):
its orthogonalized update carries bfloat16's 8-bit significand, a relative rounding of 2^-8 (3.9e-3) per element at
each of its 5 iterations, so two implementations of the same Muon step agree only to that resolution: a Muon update
is held to 2e-2 of its size (about five bfloat16 roundings). The same torch Muon on the same CPU gives the same bits.
"""

from __future__ import annotations

import inspect
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


LOSS_KEYWORDS = ("loss_config", "gamma", "per_position_loss_weight", "dpace_alpha", "max_anchors")


class ReferenceModel:
    """speculators' own model class the drafter is, built from its recorded config with its untrained weights; `run`
    gives a step's draft logits, loss and gradients from that step's trained weights and batch."""

    def __init__(self, facts: dict, untrained: dict[str, torch.Tensor], family: str):
        import importlib

        module_name, _, qualname = str(facts.get("class", "")).partition(":")
        if not module_name.startswith("speculators.models.") or "." in qualname:
            raise ValueError(f"{facts.get('class')!r} is not one of speculators' model classes")
        self.cls = getattr(importlib.import_module(module_name), qualname)
        config = self.cls.config_class.from_dict(facts["config"])
        layer = getattr(config, "transformer_layer_config", None)
        if facts.get("attn_implementation") and layer is not None:  # the team's kernel, as its config ran it
            layer._attn_implementation = facts["attn_implementation"]
        self.model = self.cls(config)
        self.untrained = untrained
        self.family = family
        self.logits: list[torch.Tensor] = []
        self.model.lm_head.register_forward_hook(lambda _m, _a, out: self.logits.append(out.detach()))

    def loss_keywords(self, settings: dict) -> tuple[dict | None, str]:
        """speculators' trainer's loss keywords for the team's loss kind (None: its kind is not one speculators
        trains with), and what the kind was read from."""
        from reference_adapters.speculators_run_recipe import reference_loss_kwargs

        terms = (settings.get("loss_config") or {}).get("loss_terms") if isinstance(settings.get("loss_config"),
                                                                                    dict) else None
        if settings.get("loss_config") is None:  # the forward's own default (speculators' DFlash metrics: KL, eager)
            kind, implementation = "kl_div", "eager"
        elif terms and len(terms) == 1 and next(iter(terms)) in ("kl_div", "ce"):
            kind = next(iter(terms))
            implementation = "fused" if ".fused:" in terms[kind]["fn"] else "eager"
        else:
            return None, f"the loss terms {sorted(terms or [])}"
        anchors = settings.get("max_anchors", inspect.signature(self.cls.forward).parameters["max_anchors"].default)
        return reference_loss_kwargs(self.cls, self.family, kind, implementation, int(anchors)), kind

    def run(self, params: dict[str, torch.Tensor], batch: dict[str, torch.Tensor], settings: dict,
            rngs: dict[str, torch.Tensor], device: str,
            loss_keywords: dict) -> tuple[torch.Tensor | None, float, dict[str, torch.Tensor]]:
        """On the device type the team's call ran on, from its random state (the anchors its call drew there)."""
        state = {**self.untrained, **params}
        self.model.load_state_dict(state, strict=True)
        self.model.to(device)
        self.model.zero_grad(set_to_none=True)
        self.logits.clear()
        others = {k: v for k, v in settings.items() if k not in LOSS_KEYWORDS and not isinstance(v, dict)}
        placed = {name: t.to(device) for name, t in batch.items()}
        with torch.random.fork_rng(devices=[torch.device(device)] if "device" in rngs else [],
                                   device_type=torch.device(device).type):
            torch.set_rng_state(rngs["cpu"])
            if "device" in rngs:
                torch.get_device_module(device).set_rng_state(rngs["device"], torch.device(device))
            _, loss, _ = self.model(**placed, **others, **loss_keywords)
        loss.backward()
        grads = {n: p.grad.detach().to("cpu", copy=True) for n, p in self.model.named_parameters()
                 if p.grad is not None}
        logits = self.logits[0].to("cpu") if self.logits else None
        return logits, float(loss.detach()), grads


def _forward_and_loss(result: dict, k: int, reference: ReferenceModel, step: dict, batch: dict, backwards: int) -> bool:
    """Phases forward, loss and the loss's gradient of step k + 1; True when they part (result['parted'] set)."""
    keywords, kind = reference.loss_keywords(batch["settings"])
    if keywords is None:
        result["forward"] = f"not run beside the team's: {kind} are not one loss speculators trains with"
        return False
    logits, loss, grads = reference.run(step["param"], step["batch"], batch["settings"], step["rng"],
                                        batch.get("device") or "cpu", keywords)
    team_logits = step["out"].get("logits")
    if team_logits is not None and logits is not None:
        if team_logits.shape != logits.shape:
            result["parted"] = {"step": k + 1, "phase": "forward", "parameter": "lm_head output",
                                "what": f"draft logits of shape {list(team_logits.shape)}, speculators' "
                                        f"{list(logits.shape)}"}
            return True
        difference = _relative(team_logits, logits, logits)
        if difference > FLOAT32_RELATIVE:
            result["parted"] = {"step": k + 1, "phase": "forward", "parameter": "lm_head output",
                                "difference": difference, "tolerance": FLOAT32_RELATIVE,
                                "what": f"the draft logits differ by {difference:.3g} of their norm from speculators' "
                                        f"{reference.cls.__name__} on the same weights and batch"}
            return True
    team_loss = batch.get("loss")
    if team_loss is not None:
        difference = abs(team_loss - loss) / max(abs(loss), 1e-30)
        if difference > FLOAT32_RELATIVE:
            result["parted"] = {"step": k + 1, "phase": "loss", "parameter": "loss", "difference": difference,
                                "tolerance": FLOAT32_RELATIVE,
                                "what": f"the loss is {team_loss:.7g}, speculators' {kind} loss as its trainer "
                                        f"resolves it {loss:.7g} (relative {difference:.3g})"}
            return True
    if backwards != 1:
        return False  # several backwards: the step's gradient sums micro-batches the batch kept is one of
    for name, ref_grad in grads.items():
        team = step["raw"].get(name)
        if team is None:
            continue
        difference = _relative(team, ref_grad, ref_grad)
        if difference > FLOAT32_RELATIVE:
            result["parted"] = {"step": k + 1, "phase": "gradient", "parameter": name, "difference": difference,
                                "tolerance": FLOAT32_RELATIVE,
                                "what": f"after backward the gradient differs by {difference:.3g} of its norm from "
                                        "the reference loss's"}
            return True
    return False


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
    steps = [{"param": {}, "grad": {}, "raw": {}, "batch": {}, "rng": {}, "out": {}}
             for _ in range(int(parity["steps"]))]
    untrained = {}
    for key, value in tensors.items():
        head, kind, name = key.split("/", 2)
        if head == "model" and kind == "untrained":
            untrained[name] = value
        elif head.startswith("step") and head[4:].isdigit() and int(head[4:]) < len(steps):
            steps[int(head[4:])].setdefault(kind, {})[name] = value
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
              "tolerance": {"logits": FLOAT32_RELATIVE, "loss": FLOAT32_RELATIVE, "gradient": FLOAT32_RELATIVE,
                            "adamw_update": FLOAT32_RELATIVE,
                            "muon_update": MUON_RELATIVE},
              "schedule": f"speculators' linear schedule over {total} steps" if total else
                          "the run's own lr factors (its total is not known), at speculators' base lr"}
    lrs = [s["lrs"] for s in run_facts.get("steps", [])]
    batches = parity.get("batches") or []
    reference = None
    if parity.get("model") and any(batches):
        try:
            reference = ReferenceModel(parity["model"], untrained, ref.family)
            result["forward"] = f"speculators' {reference.cls.__name__} run beside the team's on its batches"
        except (ValueError, KeyError, RuntimeError, AttributeError) as exc:
            result["forward"] = f"not run beside the team's: speculators' model could not be built from the " \
                                f"recorded drafter ({str(exc).splitlines()[0][:160]})"
    elif parity.get("other_drafter"):
        result["forward"] = (f"not run beside the team's: the drafter ({parity['other_drafter']}) is not one of "
                             "speculators' model classes, so its batch is not in speculators' terms")
    for k in range(len(steps) - 1):
        now, after = steps[k], steps[k + 1]
        batch = batches[k] if k < len(batches) else None
        if reference is not None and batch is not None and now["batch"]:
            device = str(batch.get("device") or "cpu")
            if not (device == "cpu" or torch.get_device_module(device).is_available()):
                result["forward"] = f"not run beside the team's: its anchors were drawn on a {device} device's " \
                                    "generator, and no such device is here to replay it"
                reference = None
            else:
                backwards = int((run_facts.get("steps") or [{}] * (k + 1))[k].get("backwards") or 0)
                try:
                    if _forward_and_loss(result, k, reference, now, batch, backwards):
                        return result
                except RuntimeError as exc:  # the recorded weights do not load into speculators' class
                    result["forward"] = f"not run beside the team's: {str(exc).splitlines()[0][:160]}"
                    reference = None
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

"""The batch of each parity step (`trace --parity K`) as the team's drafter took it, so that speculators' own model and
loss can be run on it beside the recorded run (run/parity.py).

Kept only when the drafter is one of speculators' model classes (or a subclass of one): its forward's arguments
name the batch in speculators' own terms (hidden_states, input_ids, loss_mask, verifier_last_hidden_states,
document_ids, ...), so the reference model takes them as they are. For each step, the first outermost call of the
drafter gives:
- its tensor arguments, bound to the forward's parameter names, and its other arguments as plain values (the loss
  config as its term names, functions and weights);
- the random generator's state as the call began (speculators draws the anchors with `torch.randperm`: the reference
  draws the same ones from the same state);
- what the call produced: the draft logits (the output of its `lm_head`) and the loss it returned.
Once per run: the class, its config and the weights that are not trained (embeddings, the verifier's head, buffers).
Any other drafter: nothing is kept, and the parity says its forward and loss were not run beside it.
"""

from __future__ import annotations

import inspect
import json

import torch
from torch import nn

from dflash_audit.trace.record.hooks import Observer

SPECULATORS_MODELS = "speculators.models."


def speculators_class(module: nn.Module) -> type | None:
    """speculators' own model class the drafter is (the most derived one in its class's ancestry), else None."""
    for cls in type(module).__mro__:
        if cls.__module__.startswith(SPECULATORS_MODELS) and hasattr(cls, "_backbone_forward"):
            return cls
    return None


def unwrapped(module: nn.Module) -> nn.Module:
    """The model inside a wrapper that forwards its call as it is (DDP's and accelerate's `.module`, a compiled
    module's `_orig_mod`)."""
    for attribute in ("module", "_orig_mod"):
        inner = getattr(module, attribute, None)
        if isinstance(inner, nn.Module):
            return unwrapped(inner)
    return module


def _plain(value):
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    if isinstance(value, dict) and all(isinstance(v, tuple) and len(v) == 2 and callable(v[0])
                                       for v in value.values()):  # speculators' LossConfig: name -> (fn, weight)
        return {"loss_terms": {name: {"fn": f"{fn.__module__}:{fn.__qualname__}", "weight": float(weight)}
                               for name, (fn, weight) in value.items()}}
    return {"unreadable": type(value).__name__}


class BatchCapture(Observer):
    """`enter`, called by the run recorder as the drafter's outermost call begins; `forward_leave`, from the process's
    hooks (record/hooks.py) as module calls end, the drafter's among them."""

    def __init__(self):
        self.call: dict | None = None  # the call in progress
        self.batch: dict | None = None  # this step's batch, once its first call ended
        self.model: dict | None = None  # the class, config and untrained weights (the first call's)
        self.other: str | None = None  # the drafter's class when it is not speculators' (nothing kept)

    def enter(self, module: nn.Module) -> None:
        if self.call is not None or self.batch is not None:
            return
        inner = unwrapped(module)
        cls = speculators_class(inner)
        if cls is None:
            self.other = f"{type(inner).__module__}:{type(inner).__qualname__}"
            return
        device = next((p.device for p in inner.parameters()), torch.device("cpu"))
        call = {"module": module, "inner": inner, "class": cls, "device": device.type, "rng": torch.get_rng_state()}
        if device.type != "cpu":
            call["device_rng"] = torch.get_device_module(device).get_rng_state(device)
        head = getattr(inner, "lm_head", None)
        if isinstance(head, nn.Module):
            def keep_logits(_module, _args, out) -> None:  # returns None: the output is left as it is
                if "logits" not in call and isinstance(out, torch.Tensor):
                    call["logits"] = out.detach().to("cpu", copy=True)

            call["head"] = head.register_forward_hook(keep_logits)
        self.call = call

    def forward_leave(self, module: nn.Module, args: tuple, kwargs: dict, output) -> None:
        call = self.call
        if call is None or module is not call["module"]:
            return
        self.call = None
        if "head" in call:
            call["head"].remove()
        module = call["inner"]
        try:
            bound = inspect.signature(module.forward).bind(*args, **kwargs)
        except TypeError:
            return
        tensors, settings = {}, {}
        for name, value in bound.arguments.items():
            if name == "kwargs" and isinstance(value, dict):  # **kwargs: each passed name on its own
                items = value.items()
            else:
                items = [(name, value)]
            for key, item in items:
                if isinstance(item, torch.Tensor):
                    tensors[key] = item.detach().to("cpu", copy=True)
                else:
                    settings[key] = _plain(item)
        loss = output[1] if isinstance(output, (tuple, list)) and len(output) > 1 else None
        self.batch = {"tensors": tensors, "settings": settings, "rng": call["rng"], "device": call["device"],
                      "device_rng": call.get("device_rng"), "logits": call.get("logits"),
                      "loss": float(loss.detach().float()) if isinstance(loss, torch.Tensor) and loss.numel() == 1
                      else None}
        if self.model is None:
            trained = {name for name, p in module.named_parameters() if p.requires_grad}
            config = getattr(module, "config", None)
            layer = getattr(config, "transformer_layer_config", None)
            self.model = {"class": f"{call['class'].__module__}:{call['class'].__qualname__}",
                          "config": json.loads(config.to_json_string()) if config is not None else None,
                          "attn_implementation": getattr(layer, "_attn_implementation", None),
                          "untrained": {name: t.detach().to("cpu", copy=True)
                                        for name, t in module.state_dict().items() if name not in trained}}

    def take(self) -> dict | None:
        """This step's batch (None: the drafter was not called as speculators' model); the next step starts."""
        batch, self.batch, self.call = self.batch, None, None
        return batch

"""Non-finite activations of a drafter while it runs: fc fusion overflowing float16 is the known case.

Forward hooks on every submodule keep one flag each, on the drafter's device, and never
synchronise while the drafter runs; the flags are read once at the end. The culprit is the
first module, in the order they ran, whose output was ever non-finite: the ones after it
only inherit its inf or NaN.
"""

from __future__ import annotations

import torch
from torch import nn

from foundation.placement import model_device


class OverflowWatch:
    def __init__(self, model: nn.Module):
        device = model_device(model)
        modules = [(name, module) for name, module in model.named_modules() if name]
        self.flags = {name: torch.zeros((), dtype=torch.bool, device=device) for name, _ in modules}
        self.order: dict[str, None] = {}  # module names in the order they first ran
        self.handles = [module.register_forward_hook(self._hook(name)) for name, module in modules]

    def _hook(self, name: str):
        flag = self.flags[name]

        def check(_module, _inputs, output):
            self.order.setdefault(name)
            out = output[0] if isinstance(output, tuple) else output
            if isinstance(out, torch.Tensor) and out.is_floating_point():
                flag.logical_or_(~torch.isfinite(out).all())
        return check

    def close(self) -> str | None:
        """Remove the hooks; the first module (in the order they ran) whose output was ever non-finite, or None."""
        for handle in self.handles:
            handle.remove()
        return next((name for name in self.order if bool(self.flags[name])), None)

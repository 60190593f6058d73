"""A TorchFunctionMode that records every tensor factory call in the project's own code that does
not say where its tensor goes, and every op whose tensor inputs sit on different devices.

On a CPU-only machine every tensor lands on "cpu" whatever the code says, so checking where a
tensor *went* can never fail there. What can fail is the code: a `torch.zeros(n)` with no
`device=` lands on the CPU even when the models are on a GPU. So the check is on the call: a
factory called from a watched file without a `device` argument (or with `device=None`) is a
violation, wherever it ran. `DFLASH_AUDIT_DEVICE=cuda` runs the same tests with the models on a
GPU (`make gpu-check`), where the op-input check also bites.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

from dflash_world.suite_placement import audit_device  # noqa: F401 -- the tests' one device switch

REPO = Path(__file__).resolve().parents[1]
WATCHED = (REPO / "foundation", REPO / "impl", REPO / "dflash_audit")  # the dynamic path's code
FACTORIES = {torch.zeros, torch.ones, torch.empty, torch.full, torch.arange, torch.tensor, torch.as_tensor,
             torch.rand, torch.randn, torch.randint, torch.eye, torch.linspace, torch.logspace,
             torch.empty_strided, torch.randperm, torch.scalar_tensor}


@dataclass
class DeviceAudit(TorchFunctionMode):
    watched: tuple[Path, ...] = WATCHED
    violations: list[str] = field(default_factory=list)
    factory_calls: int = 0  # watched factory calls seen: the check is not vacuous

    def __post_init__(self):
        super().__init__()
        self.roots = tuple(str(p) for p in self.watched)

    def _caller(self) -> str | None:
        frame = sys._getframe(2)  # 0: _caller, 1: __torch_function__, 2: who called the torch function
        name = frame.f_code.co_filename
        return f"{Path(name).relative_to(REPO)}:{frame.f_lineno}" if name.startswith(self.roots) else None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in FACTORIES:
            where = self._caller()
            if where is not None:
                self.factory_calls += 1
                if kwargs.get("device") is None:
                    self.violations.append(f"{where}: torch.{func.__name__} without device=")
        else:
            devices = {a.device for a in (*args, *kwargs.values())
                       if isinstance(a, torch.Tensor) and not (a.device.type == "cpu" and a.dim() == 0)}
            if len(devices) > 1:
                self.violations.append(f"{self._caller() or 'third-party code'}: {getattr(func, '__name__', func)} "
                                       f"on {sorted(map(str, devices))}")
        return func(*args, **kwargs)

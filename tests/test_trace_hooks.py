"""The recorders' one set of torch patches (dflash_audit/trace/record/hooks.py): put on once however many recorders
are installed, taken off once, torch's own functions and hooks back after any order of removal; the observers
called in the order stacked patches would call them."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch.nn.modules import module as module_api
from torch.optim import Optimizer
from torch.optim import optimizer as optimizer_api
from torch.optim.lr_scheduler import LRScheduler

from dflash_audit.trace.record.hooks import HOOKS, Observer
from dflash_audit.trace.record.recorder import Recorder


def torch_state() -> dict:
    """Everything the hooks patch or register, as torch holds it now."""
    return {"backward": torch.autograd.backward, "clip": torch.nn.utils.clip_grad_norm_,
            "clip_in_module": torch.nn.utils.clip_grad.clip_grad_norm_, "optimize": torch._dynamo.optimize,
            "optimizer_init": Optimizer.__init__, "optimizer_load": Optimizer.load_state_dict,
            "scheduler_init": LRScheduler.__init__, "scheduler_load": LRScheduler.load_state_dict,
            "forward_pre_hooks": dict(module_api._global_forward_pre_hooks),
            "forward_hooks": dict(module_api._global_forward_hooks),
            "always_called": dict(module_api._global_forward_hooks_always_called),
            "with_kwargs": dict(module_api._global_forward_hooks_with_kwargs),
            "optimizer_pre_hooks": dict(optimizer_api._global_optimizer_pre_hooks),
            "stance": torch._dynamo.eval_frame._stance.stance, "warning_filters": list(warnings.filters)}


@pytest.mark.parametrize("outer_first", [True, False], ids=["inner-removed-first", "outer-removed-first"])
def test_nested_recorders_install_the_patches_once_and_restore_them(tmp_path, outer_first):
    before = torch_state()
    outer = Recorder(tmp_path / "outer", steps=0).install()
    once = torch_state()
    assert once["backward"] is not before["backward"] and once["clip"] is once["clip_in_module"] is not before["clip"]
    assert once["stance"] == "force_eager" and len(once["warning_filters"]) == len(before["warning_filters"]) + 1
    for name in ("forward_pre_hooks", "forward_hooks", "optimizer_pre_hooks"):
        assert len(once[name]) == len(before[name]) + 1, name
    inner = Recorder(tmp_path / "inner", steps=0, parity=1).install()  # a test's record_script under the bootstrap's
    assert torch_state() == once  # nothing put on a second time
    assert len(HOOKS.observers) == 7  # per recorder: itself, its evaluation capture, its run; the parity capture
    first, last = (inner, outer) if outer_first else (outer, inner)
    first.remove()
    assert torch_state() == once
    first.remove()  # removing twice (a refusal, then record_script's own cleanup) takes nothing else off
    assert torch_state() == once
    last.remove()
    assert torch_state() == before and not HOOKS.observers


class Log(Observer):
    def __init__(self, name: str, log: list):
        self.name, self.log = name, log

    def forward_enter(self, module, args):
        self.log.append((self.name, "enter", type(module).__name__))

    def forward_leave(self, module, args, kwargs, output):
        self.log.append((self.name, "leave", type(module).__name__))

    def backward_begins(self, tensors):
        self.log.append((self.name, "backward begins"))

    def backward_ended(self, tensors):
        self.log.append((self.name, "backward ended"))

    def optimizer_made(self, optimizer):
        self.log.append((self.name, "optimizer made"))

    def optimizer_step(self, optimizer):
        self.log.append((self.name, "optimizer step"))

    def clipped(self, max_norm, norm_type, total):
        self.log.append((self.name, "clipped", max_norm))


def test_observers_are_called_in_the_order_stacked_patches_gave():
    """torch's global hooks: in the order added; a patched function: before it newest first, after it oldest first
    (the recorder sees a backward before the run recorder sees it end). A patched function kept by the script past
    the removal calls no observer."""
    torch.manual_seed(0)
    log: list = []
    first, second = Log("first", log), Log("second", log)
    HOOKS.add(first)
    HOOKS.add(second)
    try:
        layer = nn.Linear(3, 2)
        optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
        loss = layer(torch.ones(1, 3)).sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(layer.parameters(), 0.5)
        optimizer.step()
        kept = torch.autograd.backward
    finally:
        HOOKS.discard(second)
        HOOKS.discard(first)
    assert log == [("first", "optimizer made"), ("second", "optimizer made"),
                   ("first", "enter", "Linear"), ("second", "enter", "Linear"),
                   ("first", "leave", "Linear"), ("second", "leave", "Linear"),
                   ("second", "backward begins"), ("first", "backward begins"),
                   ("first", "backward ended"), ("second", "backward ended"),
                   ("first", "clipped", 0.5), ("second", "clipped", 0.5),
                   ("first", "optimizer step"), ("second", "optimizer step")]
    log.clear()
    kept(layer(torch.ones(1, 3)).sum())
    assert log == [] and layer.weight.grad is not None

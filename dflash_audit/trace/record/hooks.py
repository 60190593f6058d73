"""The torch patches and global hooks every recorder of the process reads through, each put on once and taken off
once: the first observer added installs them all, the last one discarded restores torch's own functions.

The observers, in the order the recorder adds them (record/recorder.py `Recorder.install`):
- the step recorder (`Recorder`): module calls, the backward that opens a step, optimizers made and stepped, compiles;
- the evaluator's capture (evaluation/recorder.py `EvaluationCapture`): module calls that end, until a training step;
- the run recorder (run/recorder.py `RunRecorder`): module calls, backwards ended, optimizers and schedulers made
  and loaded, gradient clipping (its optimizer-step facts are taken by the step recorder, before it closes a step);
- the parity capture (run/parity_capture.py `BatchCapture`, under --parity): the drafter's calls that end.
A recorder installed inside another (a test's `record_script`, two recorders in one process) adds its observers
after those already there; the callbacks keep the order separate patches stacked on one another would give: torch's
global hooks (forward, optimizer step) call the observers in the order they were added; a patched function's
before-callbacks run newest first and its after-callbacks oldest first, as nested wrappers would.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Callable, Iterator

import torch

# A compiled module warns on each call that global hooks fire once more for its wrapper: they are these hooks, and
# the recorder unwraps the wrapper (recorder.py `unwrap`); the user is not told about the tool's hooks.
COMPILED_WRAPPER_WARNING = r"Using `torch\.compile\(module\)` when there are global hooks"


class Observer:
    """One callback per event the hooks report; an observer overrides those it needs, the rest do nothing."""

    def forward_enter(self, module, args) -> None:
        """A module's forward begins (torch's global forward pre-hook)."""

    def forward_leave(self, module, args, kwargs: dict, output) -> None:
        """A module's forward ended, or raised (torch's global forward hook, always called)."""

    def backward_begins(self, tensors) -> None:
        """`torch.autograd.backward` (Tensor.backward, accelerate's, DeepSpeed's) is called: its graph is whole."""

    def backward_ended(self, tensors) -> None:
        """That backward returned: the gradients are in place."""

    def optimizer_made(self, optimizer) -> None:
        """An optimizer's `__init__` returned."""

    def optimizer_loading(self, optimizer) -> None:
        """An optimizer's `load_state_dict` is called."""

    def optimizer_step(self, optimizer) -> None:
        """An optimizer's `step()` is about to apply (torch's global optimizer step pre-hook)."""

    def scheduler_made(self, scheduler) -> None:
        """A learning-rate scheduler's `__init__` returned."""

    def scheduler_loading(self, scheduler) -> None:
        """A scheduler's `load_state_dict` is called."""

    def clipped(self, max_norm, norm_type, total) -> None:
        """`clip_grad_norm_` returned `total`, the norm before clipping."""

    def compiled_code_ran(self) -> None:
        """A call of what the script compiled (`torch.compile`, `Module.compile`) begins (run eagerly)."""


class TorchHooks:
    """The process's one set of patches (`HOOKS`), held while any observer is added."""

    def __init__(self) -> None:
        self.observers: list[Observer] = []
        self.undo: list[Callable[[], None]] = []  # each patch's removal, in the order they were put on

    def observing(self, observer: Observer) -> bool:
        return any(o is observer for o in self.observers)

    def add(self, observer: Observer) -> None:
        if self.observing(observer):
            return
        if not self.observers:
            self._install()
        self.observers.append(observer)

    def discard(self, observer: Observer) -> None:
        if not self.observing(observer):
            return
        self.observers = [o for o in self.observers if o is not observer]
        if not self.observers:
            self._uninstall()

    def _each(self, newest_first: bool = False) -> Iterator[Observer]:
        """The observers as the call began, each skipped once discarded (a recorder removed by an earlier one)."""
        observers = tuple(self.observers)
        for observer in (reversed(observers) if newest_first else observers):
            if self.observing(observer):
                yield observer

    # -- the global hooks --------------------------------------------------------------------------------------------
    def _forward_enter(self, module, args) -> None:
        for observer in self._each():
            observer.forward_enter(module, args)

    def _forward_leave(self, module, args, *rest) -> None:
        # (kwargs, output) as registered with_kwargs; torch.compile's dynamo calls a global hook without the kwargs
        kwargs, output = rest if len(rest) == 2 else ({}, rest[0])
        for observer in self._each():
            observer.forward_leave(module, args, kwargs, output)

    def _optimizer_step(self, optimizer, args, kwargs) -> None:
        for observer in self._each():
            observer.optimizer_step(optimizer)

    # -- installing ----------------------------------------------------------------------------------------------
    def _install(self) -> None:
        try:
            self._install_compile_stance()
            self._install_global_hooks()
            self._install_patches()
        except BaseException:
            self._uninstall()
            raise

    def _uninstall(self) -> None:
        undo, self.undo = self.undo, []
        for remove in reversed(undo):
            remove()

    def _patch(self, owner, name: str, replacement) -> None:
        original = getattr(owner, name)
        setattr(owner, name, replacement)
        self.undo.append(lambda: setattr(owner, name, original))

    def _install_compile_stance(self) -> None:
        """torch.compile'd code runs eagerly while recording: inside a compiled module no per-module hook fires (its
        submodules are traced into one graph), so what the drafter consumed and produced would not be seen. Dynamo's
        own switch, the compiler's "force_eager" stance, set for this process until the hooks are removed: every
        torch.compile'd module or function (a drafter, a whole step, fullgraph or not, compiled before or after)
        runs the same operations eagerly, and the script's objects stay what it made (an `OptimizedModule` keeps
        its `_orig_mod`). `torch._dynamo.optimize` (what torch.compile and Module.compile call) is wrapped only to
        note, for the report, that compiled code ran: each call of what it compiled enters its context's hooks. A
        compile that never runs (speculators' DFlash module compiles `create_block_mask` on import, and an eager
        attention never calls it) changed nothing the step did, so it is not said."""
        stance = torch.compiler.set_stance("force_eager")
        self.undo.append(lambda: stance.__exit__(None, None, None))  # the stance the process had before
        optimize, hooks = torch._dynamo.optimize, self

        def ran_compiled():
            for observer in hooks._each():
                observer.compiled_code_ran()
            return lambda: None  # the hook's exit: nothing to undo

        def noted_optimize(*args, **kwargs):
            context = optimize(*args, **kwargs)
            if isinstance(getattr(context, "enter_exit_hooks", None), list):  # none where dynamo is disabled
                context.enter_exit_hooks.append(ran_compiled)
            return context

        self._patch(torch._dynamo, "optimize", noted_optimize)
        warnings.filterwarnings("ignore", message=COMPILED_WRAPPER_WARNING, category=UserWarning)
        kept = warnings.filters[0]

        def remove_filter() -> None:
            with contextlib.suppress(ValueError):
                warnings.filters.remove(kept)

        self.undo.append(remove_filter)

    def _install_global_hooks(self) -> None:
        from torch.nn.modules import module as module_api
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        # Run eagerly under torch.compile (dynamo would trace the observers' own bookkeeping into the graph).
        enter, leave = torch._dynamo.disable(self._forward_enter), torch._dynamo.disable(self._forward_leave)
        leaving = module_api.register_module_forward_hook(leave, with_kwargs=True, always_call=True)
        for handle in (module_api.register_module_forward_pre_hook(enter), leaving,
                       register_optimizer_step_pre_hook(self._optimizer_step)):
            self.undo.append(handle.remove)
        # torch's handle forgets the hook's with_kwargs flag: taken off too, so that nothing of the hooks stays
        self.undo.append(lambda: module_api._global_forward_hooks_with_kwargs.pop(leaving.id, None))

    def _install_patches(self) -> None:
        from torch.optim import Optimizer
        from torch.optim.lr_scheduler import LRScheduler

        hooks = self
        backward = torch.autograd.backward

        def observed_backward(tensors, *args, **kwargs):
            for observer in hooks._each(newest_first=True):
                observer.backward_begins(tensors)
            result = backward(tensors, *args, **kwargs)
            for observer in hooks._each():
                observer.backward_ended(tensors)
            return result

        clip = torch.nn.utils.clip_grad_norm_

        @functools.wraps(clip)
        def observed_clip(parameters, max_norm, norm_type=2.0, *args, **kwargs):
            total = clip(parameters, max_norm, norm_type, *args, **kwargs)
            for observer in hooks._each():
                observer.clipped(max_norm, norm_type, total)
            return total

        def made(init, callback: str):
            def observed_init(self, *args, **kwargs):
                init(self, *args, **kwargs)
                for observer in hooks._each():
                    getattr(observer, callback)(self)

            return observed_init

        def loading(load, callback: str):
            def observed_load(self, *args, **kwargs):
                for observer in hooks._each(newest_first=True):
                    getattr(observer, callback)(self)
                return load(self, *args, **kwargs)

            return observed_load

        self._patch(torch.autograd, "backward", observed_backward)  # Tensor.backward calls it too
        self._patch(torch.nn.utils, "clip_grad_norm_", observed_clip)
        self._patch(torch.nn.utils.clip_grad, "clip_grad_norm_", observed_clip)
        self._patch(Optimizer, "__init__", made(Optimizer.__init__, "optimizer_made"))
        self._patch(Optimizer, "load_state_dict", loading(Optimizer.load_state_dict, "optimizer_loading"))
        self._patch(LRScheduler, "__init__", made(LRScheduler.__init__, "scheduler_made"))
        self._patch(LRScheduler, "load_state_dict", loading(LRScheduler.load_state_dict, "scheduler_loading"))


HOOKS = TorchHooks()

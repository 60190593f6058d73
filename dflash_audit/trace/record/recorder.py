"""The recorder inside the traced script: what flowed through one training step, kept by reference while the step
runs and written at `trace.step(loss)` as one safetensors file plus a JSON manifest (dflash_audit/trace/record/recording.py).

The step needs no line in the script: it is the first `backward()` of a scalar that reaches a trainable parameter
(the backward is wrapped, so the graph is walked before it is freed), bounded by the optimizer's next `step()` (the
backwards between are the step's micro-batches); with no optimizer, each such backward is a step. `trace.step(loss)`
stays as the explicit form (then the backwards are left alone).

One global forward hook (every module call, with its keyword arguments) keeps, by reference only:
- every call of a Hugging Face model that has an output head (a target candidate) and its input ids;
- every embedding call (its ids and output) and the models enclosing it;
- every tensor that enters a module with trainable weights from outside the autograd graph (fc's context features,
  the block's embeddings: what the drafter consumed);
- every head-like linear output that carries gradient (the draft logits).
At `step(loss)` the loss's autograd graph is walked: its trainable leaves name the drafter (the module owning them),
and the tensors its nodes saved name the loss-side inputs no module produced (targets, labels, weights, masks).
Only then is anything copied; the script's own names for its tensors are never needed.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from dflash_audit.trace.evaluation.recorder import EvaluationCapture
from dflash_audit.trace.record.hooks import HOOKS, Observer
from dflash_audit.trace.record.manifest import ManifestRefused
from dflash_audit.trace.record.marks import Mark, mark
from dflash_audit.trace.record.options import RecorderOptions
from dflash_audit.trace.record.recording import MANIFEST, write_error, write_recording
from dflash_audit.trace.record.sharded import local_value

INSTALLED: list[Recorder] = []  # the recorder of this process (the bootstrap's, or a test's record_script)


class TraceStop(SystemExit):
    """Raised from `trace.step` once the steps asked for are recorded: the script ends cleanly (status 0)."""

    def __init__(self, code: int = 0):
        super().__init__(code)


class TraceRefused(Exception):
    """The step cannot be audited (no drafter parameter in the loss, two targets, ...): one line for the verb.
    `flag`: the verb's flag the refusal is about (`--drafter-class`, `--target`), when it is one of the user's flags
    that does not fit the script rather than the script itself."""

    def __init__(self, message: str, flag: str | None = None):
        super().__init__(message)
        self.flag = flag


@dataclass
class ModelCall:
    model: nn.Module
    input_ids: torch.Tensor | None
    attention_mask: torch.Tensor | None
    position_ids: torch.Tensor | None = None
    packed: tuple[int, int] | None = None  # a document cut from a packed row: (its first position, the row's length)


@dataclass
class StepCalls:
    """What the step's module calls carried. `call` tags: the number of the outermost call of a module holding
    trainable weights (the drafter's calls: one per block, per anchor or per micro-batch), so that each tensor is
    read with the others of its own call."""
    models: list[ModelCall] = field(default_factory=list)
    embeds: list[tuple[nn.Module, torch.Tensor, tuple[int, ...], tuple[int, ...], tuple]] = field(default_factory=list)
    fed: list[tuple[nn.Module, torch.Tensor, int]] = field(default_factory=list)
    heads: list[tuple[nn.Module, torch.Tensor, int]] = field(default_factory=list)
    kwargs: list[tuple[nn.Module, str, torch.Tensor, int]] = field(default_factory=list)
    roots: dict[int, nn.Module] = field(default_factory=dict)  # modules called from no other module
    # Tensors bound in a module's parameters' places during its calls (torch.func.functional_call): id -> (module,
    # the parameter's name, the tensor); the weights such a step trains.
    stand_ins: dict[int, tuple[nn.Module, str, torch.Tensor]] = field(default_factory=dict)

def is_target_like(module: nn.Module) -> bool:
    """A Hugging Face model with an output head and a stack of decoder layers (a causal LM)."""
    get_out = getattr(module, "get_output_embeddings", None)
    if get_out is None or getattr(module, "config", None) is None:
        return False
    try:
        head = get_out()
        decoder = module.get_decoder() if hasattr(module, "get_decoder") else None
    except Exception:  # noqa: BLE001 -- a model without these is not a target
        return False
    return head is not None and decoder is not None and hasattr(decoder, "layers")


def is_decoder_like(module: nn.Module) -> bool:
    """A Hugging Face decoder stack run on its own (`target.model(ids)`, the head applied elsewhere or not at all):
    the target's forward too, whose folder its config names."""
    return getattr(module, "config", None) is not None and isinstance(getattr(module, "layers", None), nn.ModuleList) \
        and isinstance(getattr(module, "embed_tokens", None), nn.Embedding) and hasattr(module, "norm")


def _tensors(value, prefix: str = ""):
    if isinstance(value, torch.Tensor):
        yield prefix, value
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            yield from _tensors(item, f"{prefix}[{i}]")


def _key(t: torch.Tensor) -> tuple:
    t = local_value(t)  # a sharded parameter (FSDP2 DTensor): its local shard's storage
    return (t.device, t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype)


class Recorder(Observer):
    def __init__(self, out: Path, steps: int = 1, target: str | None = None, drafter_class: str | None = None,
                 late: bool = False, evaluation: bool = False, parity: int = 0, own_process: bool = False):
        self.out = Path(out)
        # The traced command's own process (the bootstrap's recorder): once its steps are recorded, ending the
        # process is the recorder's to do (ending.py); never in a process that records a script in itself (a test).
        self.own_process = own_process
        self.begun = False  # this process began a training step (or an evaluation round): the verb is told
        self.steps = steps
        self.parity = parity  # trace --parity K: keep the first K steps' weights and gradients (run/recorder.py)
        self.target_dir = target
        self.drafter_class = drafter_class
        self.late = late  # installed at the first step(): that step's forward was not seen
        self.rank = int(os.environ.get("RANK", "0") or 0)
        self.seen = 0
        self.calls = StepCalls()
        self.recorded: list[dict] = []
        self.stack: list[nn.Module] = []
        self.depth: list[nn.Module] = []  # every module call in progress, outermost first
        self.trainable_depth = 0  # calls in progress of modules holding trainable weights
        self.call_no = 0  # outermost calls of such modules so far
        self.kinds: dict[int, tuple[bool, bool, bool, bool]] = {}
        self.installed = False  # its observers are added to the process's hooks (hooks.py)
        self.explicit = False  # the script calls trace.step(loss): the backwards are its own business
        self.pending: dict | None = None  # the step captured at its first backward, kept until the optimizer steps
        self.micro_batches = 0
        self.optimizers = 0  # optimizers made since install: with none, each backward is a step
        self.compiled = False  # the script ran torch.compile'd code (eagerly, while recording: hooks.py)
        self.run = None  # the RunRecorder (run/recorder.py)
        # The drafter's parameters the latest step trained through tensors standing in for them (functional_call):
        # id(parameter) -> the tensor the step bound in its place, which the optimizer updates.
        self.stand_ins: dict[int, torch.Tensor] = {}
        # The target's forwards seen so far, each with the step it ran in, its token ids copied (an offline trainer
        # runs the target once, before its first step, and reads its states back in the later steps).
        self.run_target: nn.Module | None = None
        self.run_target_calls: list[tuple[int, ModelCall, str]] = []  # (step, the call, the device its ids were on)
        # An evaluation's calls (dflash_audit/trace/evaluation/recorder.py), captured until a training step shows the run is
        # a trainer's (its validation loop is not an evaluation); `evaluation`: --eval, backwards left alone.
        self.eval_only = evaluation
        self.evaluation = EvaluationCapture(self._is_target_like, self.depth, self._begin) if self.rank == 0 else None

    @classmethod
    def from_options(cls, options: RecorderOptions, late: bool = False, own_process: bool = False) -> Recorder:
        return cls(options.out, steps=options.steps, target=options.target, drafter_class=options.drafter_class,
                   late=late, evaluation=options.evaluation, parity=options.parity, own_process=own_process)

    # -- hooks ---------------------------------------------------------------------------------------------------
    def install(self) -> Recorder:
        """The recorder, its evaluation capture and its run recorder added to the process's hooks (hooks.py), in
        that order: each module call is seen by the recorder first, the run's facts read what it counted."""
        HOOKS.add(self)
        self.installed = True
        if self.evaluation is not None:
            HOOKS.add(self.evaluation)
        from dflash_audit.trace.run.recorder import RunRecorder

        self.run = RunRecorder(self, self.parity).install()  # what the run does across steps (optimizers, lr, clipping, ...)
        INSTALLED[:] = [self]
        return self

    def remove(self) -> None:
        if self.run is not None:
            self.run.remove()
        if self.evaluation is not None:
            HOOKS.discard(self.evaluation)
        HOOKS.discard(self)  # the last observer of the process: torch's own functions and hooks are back
        self.installed = False
        if INSTALLED and INSTALLED[0] is self:
            INSTALLED.clear()

    def _drop_evaluation(self) -> None:
        """A training step: what ran before it (a validation loop) is no evaluation."""
        if self.evaluation is not None:
            HOOKS.discard(self.evaluation)
            self.evaluation = None

    def backward_begins(self, tensors) -> None:
        if not self.explicit and not self.eval_only:
            self._backward(tensors)

    def optimizer_made(self, optimizer) -> None:
        self.optimizers += 1

    def compiled_code_ran(self) -> None:
        self.compiled = True

    def _kind(self, module: nn.Module) -> tuple[bool, bool, bool, bool]:
        """(a target-like model, an embedding, has trainable weights of its own, any trainable weight below it)."""
        kind = self.kinds.get(id(module))
        if kind is None:
            kind = (is_target_like(module) or (is_decoder_like(module) and not any(
                        p.requires_grad for p in module.parameters())), isinstance(module, nn.Embedding),
                    any(p.requires_grad for p in module.parameters(recurse=False)),
                    any(p.requires_grad for p in module.parameters()))
            self.kinds[id(module)] = kind
        return kind

    def forward_enter(self, module, args) -> None:
        kind = self._kind(module)
        note_stand_ins(self.calls, module)
        if not self.depth:
            self.calls.roots.setdefault(id(module), module)
        self.depth.append(module)
        if kind[3]:
            if not self.trainable_depth:
                self.call_no += 1
            self.trainable_depth += 1
        if kind[0]:
            self.stack.append(module)

    def forward_leave(self, module, args, kwargs: dict, output) -> None:
        target_like, embedding, own_trainable, trainable = self._kind(module)
        if self.depth and self.depth[-1] is module:
            self.depth.pop()  # the evaluation capture, next, reads the calls still enclosing this one
        if trainable:
            self.trainable_depth = max(0, self.trainable_depth - 1)
        calls = self.calls
        call = self.call_no
        if target_like:
            if self.stack and self.stack[-1] is module:
                self.stack.pop()
            if self.stack:  # the decoder inside its causal LM's own forward: the LM's call is the target's
                return
            ids = kwargs.get("input_ids", args[0] if args and isinstance(args[0], torch.Tensor) else None)
            calls.models.append(ModelCall(module, ids, kwargs.get("attention_mask"), kwargs.get("position_ids")))
            return
        if embedding and args and isinstance(output, torch.Tensor):
            calls.embeds.append((module, args[0], tuple(output.shape), tuple(id(m) for m in self.stack),
                                 _key(output)))
        if not torch.is_grad_enabled():
            return  # a forward outside training (the target under no_grad): nothing of the drafter's
        if own_trainable:
            for _, t in (*_tensors(args), *_tensors(list(kwargs.values()))):
                if t.is_floating_point() and not t.requires_grad:
                    calls.fed.append((module, t, call))
        if trainable and not own_trainable:  # a container of trainable modules: its own keyword inputs
            for name, value in kwargs.items():
                for suffix, t in _tensors(value):
                    if not t.is_floating_point() or t.dtype == torch.bool:
                        calls.kwargs.append((module, name + suffix, t, call))
        if isinstance(module, nn.Linear) and isinstance(output, torch.Tensor) and output.requires_grad \
                and module.out_features > module.in_features:
            calls.heads.append((module, output, call))

    def _is_target_like(self, module: nn.Module) -> bool:
        return self._kind(module)[0]

    # -- the step ------------------------------------------------------------------------------------------------
    def step(self, loss) -> None:
        """The explicit form: `trace.step(loss)` before backward."""
        if self.eval_only:
            return
        self.explicit = True
        self._drop_evaluation()
        self.seen += 1
        self._begin()
        calls, self.calls = self.calls, StepCalls()
        if self.rank == 0:
            self._guarded(lambda: self.recorded.append(self._capture(loss, calls)))
        self._after_step()

    def _guarded(self, record) -> None:
        try:
            if self.late:
                raise TraceRefused("the tool's hooks were not installed before the script ran (was Python "
                                   "started with -S or -I?): the step's forward was not seen")
            record()
            if self.seen >= self.steps > 0:
                write_recording(self.out, self.recorded, self._context())
        except (TraceRefused, ManifestRefused) as exc:
            write_error(self.out, str(exc), self.seen, getattr(exc, "flag", None))
            self.remove()
            self._stop(3)

    def _after_step(self) -> None:
        if self.steps > 0 and self.seen >= self.steps:
            self.remove()
            self._stop(0)

    def _stop(self, status: int) -> None:
        """End the script: TraceStop in this thread, and in the traced command's process, the process's end even
        when the script's own threads would hold it (ending.py)."""
        if self.own_process:
            from dflash_audit.trace.record.ending import end_after_main_thread

            end_after_main_thread(status)
        raise TraceStop(status) from None

    def _begin(self) -> None:
        if not self.begun:
            self.begun = True
            mark(Mark.STEPPED)

    def _backward(self, tensors) -> None:
        """No line in the script: a backward of a scalar reaching a trainable parameter opens the step (the first
        of the step's micro-batches is recorded, its graph walked before backward frees it)."""
        loss = tensors if isinstance(tensors, torch.Tensor) else None
        if loss is None or loss.numel() != 1 or loss.grad_fn is None or not loss.is_floating_point():
            return
        if self.pending is not None and not self.optimizers:
            self._close_step()  # no optimizer: each backward is a step
        graph = walk_graph(loss)
        if not graph["params"]:
            return
        self._drop_evaluation()
        self._begin()
        calls, self.calls = self.calls, StepCalls()
        if self.pending is not None:  # accumulation: another micro-batch of the step the optimizer will close
            self.micro_batches += 1
            if self.rank == 0 and self.pending:
                self._add_micro_batch(loss, graph, calls)
            return
        self.micro_batches = 1
        if self.rank != 0:
            self.pending = {}
            return
        try:
            self.pending = self._capture(loss, calls, graph)
        except TraceRefused as exc:
            write_error(self.out, str(exc), self.seen + 1, exc.flag)
            self.remove()
            self._stop(3)

    def _add_micro_batch(self, loss, graph: dict, calls: StepCalls) -> None:
        """A later micro-batch of the step, recorded beside the first (its names prefixed `mb<n>.`); the step's loss
        is the sum of the micro-batches' losses, as their gradients sum."""
        drafter, drafter_name, target = self.pending["parts"]
        target_calls = [c for c in calls.models if c.model is target]
        self._remember(target, target_calls)
        record = step_record(loss, graph, calls, drafter, drafter_name, target, target_calls, self.seen)
        prefix = f"mb{self.micro_batches - 1}."
        for name, t in record["tensors"].items():
            self.pending["tensors"][prefix + name] = t
        for name, entry in record["meta"]["entries"].items():
            entry = dict(entry)
            for ref in ("of", "consumed_as"):
                if entry.get(ref):
                    entry[ref] = prefix + entry[ref]
            self.pending["meta"]["entries"][prefix + name] = entry
        self.pending["meta"]["loss"] += record["meta"]["loss"]

    def optimizer_step(self, optimizer) -> None:
        if self.run is not None:  # the run's facts of the step, before the step is closed (and perhaps the script)
            self.run.step_facts(optimizer)
        if self.pending is not None and not self.explicit:
            self._close_step()
            self._after_step()

    def _close_step(self) -> None:
        pending, self.pending = self.pending, None
        self.calls = StepCalls()
        self.seen += 1
        if self.rank == 0:
            pending["meta"].update(step=self.seen, micro_batches=self.micro_batches)
            self._guarded(lambda: self.recorded.append(pending))

    def finish(self) -> None:
        """The script ran to its end (`--steps 0`, or fewer steps than asked): write what was recorded."""
        if self.own_process:
            mark(Mark.EXITED)  # Python's normal exit was reached (os._exit never gets here)
        if self.pending is not None and self.installed:
            try:
                self._close_step()
            except TraceStop:
                pass
        if self.rank == 0 and self.recorded and not (self.out / MANIFEST).exists():
            try:
                write_recording(self.out, self.recorded, self._context())
            except ManifestRefused as exc:
                write_error(self.out, str(exc), self.seen)
        elif self.rank == 0 and not self.recorded and self.evaluation is not None and self.evaluation.useful():
            self.evaluation.write(self.out, self._context())

    def _context(self) -> dict:
        import torch.distributed as dist

        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        return {"rank": self.rank, "world_size": world, "argv": sys.argv, "steps_requested": self.steps,
                "compile_disabled": self.compiled,
                "run": self.run.facts(self.out if self.rank == 0 else None) if self.run is not None else None}

    def _capture(self, loss, calls: StepCalls, graph: dict | None = None) -> dict:
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise TraceRefused(f"trace.step(loss): takes the step's scalar loss tensor, got "
                               f"{type(loss).__name__}{tuple(loss.shape) if isinstance(loss, torch.Tensor) else ''}")
        if loss.grad_fn is None:
            raise TraceRefused("trace.step(loss): the loss does not depend on any trainable parameter (it has no "
                               "autograd graph; call step before backward, outside torch.no_grad)")
        graph = graph or walk_graph(loss)
        drafter, drafter_name = self._drafter(graph["params"], calls)
        self.stand_ins = {stood: calls.stand_ins[i][2] for i, stood in stand_in_ids(calls).items()}
        target_call, target = self._target(calls, drafter)
        reused = {id(call) for call in target_call}
        earlier = [(step, device) for step, call, device in self.run_target_calls if id(call) in reused]
        record = step_record(loss, graph, calls, drafter, drafter_name, target, target_call, self.seen)
        if earlier:  # no target forward of its own: its tokens are those the target ran on in these steps
            record["meta"]["target_forwards_of_steps"] = sorted({step for step, _ in earlier})
            entries = record["meta"]["entries"]
            for i, (_, device) in enumerate(earlier):  # where they were when the target ran, not the CPU copy's
                for name in (f"tokens.{i}", f"attention_mask.{i}", f"target_positions.{i}"):
                    if name in entries:
                        entries[name]["device"] = device
        record["parts"] = (drafter, drafter_name, target)  # for the step's later micro-batches; not written
        return record

    def _drafter(self, params: list[torch.Tensor], calls: StepCalls) -> tuple[nn.Module, str]:
        """The drafter: the smallest module owning every trainable parameter the loss reaches (their common
        ancestor among the modules the step called), unwrapped from DDP/FSDP/accelerate/compile, never a leaf.
        The frozen modules inside it (a copied final norm, the target's head) are not what makes it the drafter."""
        wanted = {id(p) for p in params}
        if not wanted:
            raise TraceRefused("the loss does not depend on any trainable parameter")
        seen: dict[int, nn.Module] = {}
        for root in calls.roots.values():
            for m in root.modules():
                seen.setdefault(id(m), m)
        for m in [c.model for c in calls.models] + [e[0] for e in calls.fed] + [e[0] for e in calls.heads] + \
                [e[0] for e in calls.kwargs]:
            seen.setdefault(id(m), m)
        # The graph's leaves that stand for a module's parameters: FSDP2's gathered copies, and the tensors a
        # functional call bound in their places (each read as the parameter it stood in for, trained or not).
        aliases = {**fsdp2_sharded_ids(seen.values()), **stand_in_ids(calls)}
        wanted = {aliases.get(i, i) for i in wanted}
        stood_for = set(stand_in_ids(calls).values())
        candidates = []
        for m in seen.values():
            # A module FSDP2 left unsharded after its forward (the root) registers the gathered copies themselves:
            # read as their sharded parameters, as the graph's leaves are.
            own = {aliases.get(id(p), id(p)) for p in m.parameters() if p.requires_grad or id(p) in stood_for}
            covered = len(own & wanted)
            if covered:
                candidates.append((covered, -len(own), -sum(1 for _ in m.modules()), m))
        if self.drafter_class:
            module_name, _, class_name = self.drafter_class.partition(":")
            cls = getattr(sys.modules.get(module_name), class_name, None)
            if module_name not in sys.modules:
                raise TraceRefused(f"--drafter-class {self.drafter_class}: the script imported no module "
                                   f"{module_name} (name the module that defines the class as the script imports it; "
                                   f"a class of the script itself is __main__:{class_name})", "--drafter-class")
            if not isinstance(cls, type):
                raise TraceRefused(f"--drafter-class {self.drafter_class}: module {module_name} has no class "
                                   f"{class_name}", "--drafter-class")
            candidates = [c for c in candidates if isinstance(unwrap(c[3]), cls)]
            if not candidates:
                raise TraceRefused(f"--drafter-class {self.drafter_class}: no module of that class owns a parameter "
                                   "the loss depends on", "--drafter-class")
        if not candidates:
            if not any(isinstance(p, nn.Parameter) for p in params):  # leaves made to require grad, no weight
                raise TraceRefused("the loss reaches no parameter, only tensors made to require grad (a loss detached "
                                   "from the model, then requires_grad_?): no weight gets a gradient, nothing trains")
            raise TraceRefused("the loss depends on trainable parameters of no module that ran forward in this step")
        best = max(c[0] for c in candidates)
        top = sorted((c for c in candidates if c[0] == best), key=lambda c: (c[1], c[2]), reverse=True)
        drafter = unwrap(top[0][3])
        if not any(True for _ in drafter.children()):  # a leaf owns them all: the module that calls it is the drafter
            parents = [c[3] for c in top if _contains(c[3], drafter) and any(True for _ in c[3].children())]
            if parents:
                drafter = unwrap(parents[0])
        others = [unwrap(c[3]) for c in candidates if c[0] < best and not _contains(drafter, c[3])
                  and not _contains(c[3], drafter) and c[3] is not drafter]
        others = [m for m in others if not any(_contains(o, m) for o in others)]
        if others and not self.drafter_class and best < len(wanted):
            names = sorted({type(m).__name__ for m in [drafter, *others]})
            raise TraceRefused(f"the loss depends on trainable parameters of {len(others) + 1} separate modules "
                               f"({', '.join(names)}): name the drafter with --drafter-class MODULE:CLASS")
        cls = own_class(drafter)
        return drafter, f"{cls.__module__}:{cls.__qualname__}"

    def _target(self, calls: StepCalls, drafter: nn.Module) -> tuple[list[ModelCall], nn.Module]:
        drafter_params = {id(p) for p in drafter.parameters() if p.requires_grad}  # a borrowed frozen head is the target's
        models: dict[int, nn.Module] = {}
        for call in calls.models:
            m = call.model
            # The drafter itself, also inside a wrapper that is a model to the eye (a compiled module forwards
            # `config` and the head to the model it holds), is no target.
            if unwrap(m) is drafter or _contains(drafter, m) or call.input_ids is None:
                continue
            if _contains(m, drafter):
                # The drafter built inside the target (Model-Optimizer's `convert`): the target is the rest of it,
                # when nothing of that rest trains.
                if not any(p.requires_grad and id(p) not in drafter_params for p in m.parameters()):
                    models[id(m)] = m
                continue
            if any(id(p) in drafter_params for p in m.parameters()):
                continue
            models[id(m)] = m
        if self.target_dir and not models:
            offline = self._offline_target(calls, drafter)  # a trainer on offline states: the target never ran
            if offline is not None:
                return offline
        if self.target_dir:
            wanted = os.path.realpath(self.target_dir)
            models = {k: m for k, m in models.items() if os.path.realpath(model_path(m)) == wanted}
        if not models and self.run_target is not None:
            # A later step that ran no target (the trainer reads states it stored from the target's earlier
            # forwards): the run's target, and every token id it ran on in the earlier steps, to be rerun by value.
            return [call for _, call, _ in self.run_target_calls], self.run_target
        if not models and self.target_dir:
            raise TraceRefused(f"--target {self.target_dir}: no model loaded from it ran forward in the step",
                               "--target")
        if not models:
            raise TraceRefused("no Hugging Face causal LM ran forward in the step: the target's forward was not seen")
        if len(models) > 1:
            paths = ", ".join(sorted(model_path(m) or type(m).__name__ for m in models.values()))
            raise TraceRefused(f"two or more candidate targets ran forward in the step ({paths}): name the target's "
                               "folder with --target")
        target = next(iter(models.values()))
        own = [c for c in calls.models if c.model is target]
        self._remember(target, own)
        return own, target

    def _remember(self, target: nn.Module, target_calls: list[ModelCall]) -> None:
        """The target's forwards of this step, kept for a later step that runs none: its token ids (and mask,
        positions) copied to the CPU, as the script may reuse the tensors it ran the target on."""
        if self.run_target is not target:
            self.run_target, self.run_target_calls = target, []
        step = len(self.recorded) + 1

        def copied(t):
            return t.detach().to("cpu", copy=True) if isinstance(t, torch.Tensor) else None

        self.run_target_calls += [(step, ModelCall(c.model, copied(c.input_ids), copied(c.attention_mask),
                                                   copied(c.position_ids), c.packed), str(c.input_ids.device))
                                  for c in target_calls if isinstance(c.input_ids, torch.Tensor)]

    def _offline_target(self, calls: StepCalls, drafter: nn.Module) -> tuple[list[ModelCall], nn.Module] | None:
        """A trainer reading the target's states from a dataset (vLLM's, speculators', SpecForge's) runs no target:
        with --target, the target is loaded from its folder (never run here; the audit recomputes it) and the step's
        token ids are the drafter's own `input_ids` argument. None when the drafter took no such argument."""
        drafter_calls = {id(drafter)} | {id(m) for m, _, _, _ in calls.kwargs if unwrap(m) is drafter}
        ids = [t for module, name, t, _ in calls.kwargs if id(module) in drafter_calls and name == "input_ids"
               and not t.is_floating_point()]
        # A drafter class with a head and decoder layers (speculators' DFlashDraftModel) is seen as a model call; its
        # packed row split into the documents its position ids restart at (each was one target forward when written).
        spans: list[tuple[int, int] | None] = [None] * len(ids)
        for c in calls.models:
            if unwrap(c.model) is drafter and isinstance(c.input_ids, torch.Tensor) and not c.input_ids.is_floating_point():
                documents = packed_documents(c.input_ids, c.position_ids)
                ids += [document for document, _ in documents]
                spans += [(start, c.input_ids.shape[-1]) if start is not None else None for _, start in documents]
        if not ids:
            return None
        if getattr(self, "offline_target", None) is None:
            from transformers import AutoModelForCausalLM

            from foundation.transformers_compat import from_pretrained

            self.offline_target = from_pretrained(AutoModelForCausalLM, self.target_dir, dtype=torch.float32)
            self.offline_target.eval().requires_grad_(False)
        return [ModelCall(self.offline_target, t, None, packed=span) for t, span in zip(ids, spans)], \
            self.offline_target


def packed_documents(ids: torch.Tensor, positions) -> list[tuple[torch.Tensor, int | None]]:
    """A packed row of token ids as its documents ([1, T] each), each with its first position in the row: a document
    starts where the position ids restart at 0; a one-token run is the row's padding (zeros at position 0), not a
    document. One row without positions: itself (its start None: no packing known)."""
    if not isinstance(positions, torch.Tensor) or positions.numel() != ids.numel() or ids.dim() != 2 \
            or ids.shape[0] != 1:
        return [(ids, None)]
    flat, pos = ids.reshape(-1), positions.reshape(-1)
    starts = (pos == 0).nonzero().flatten().tolist()
    ends = starts[1:] + [flat.numel()]
    return [(flat[a:b][None], a) for a, b in zip(starts, ends) if b - a > 1] or [(ids, None)]


def unwrap(module: nn.Module) -> nn.Module:
    """A drafter inside DistributedDataParallel / FSDP / accelerate's wrappers or torch.compile: the model itself."""
    while True:
        inner = getattr(module, "_orig_mod", None) if type(module).__name__ == "OptimizedModule" else \
            getattr(module, "module", None) if type(module).__name__ in (
                "DistributedDataParallel", "DataParallel", "FullyShardedDataParallel") else None
        if not isinstance(inner, nn.Module):
            return module
        module = inner


def fsdp2_sharded_ids(modules) -> dict[int, int]:
    """FSDP2 (`fully_shard`): a module's registered parameters are sharded DTensors, and its forward runs on
    gathered copies, which are the autograd graph's leaves. Each gathered copy's id -> its sharded parameter's id
    (read from the module's FSDP state, a private structure of torch 2.x: empty if it is not there)."""
    aliases: dict[int, int] = {}
    for module in modules:
        state = getattr(module, "_get_fsdp_state", None)
        try:
            group = state()._fsdp_param_group if state is not None else None
            for param in group.fsdp_params if group is not None else ():
                gathered = getattr(param, "_unsharded_param", None)
                if gathered is not None:
                    aliases[id(gathered)] = id(param.sharded_param)
        except (AttributeError, RuntimeError):
            continue
    return aliases


def note_stand_ins(calls: StepCalls, module: nn.Module) -> None:
    """The tensors bound in a module's parameters' places as it is called: torch.func.functional_call and
    torch.nn.utils.stateless put them in its `_parameters` under the parameters' names for the call (the step trains
    them, not the module's own nn.Parameters)."""
    for name, t in module._parameters.items():
        if isinstance(t, torch.Tensor) and not isinstance(t, nn.Parameter):
            calls.stand_ins.setdefault(id(t), (module, name, t))


def stand_in_ids(calls: StepCalls) -> dict[int, int]:
    """Each stand-in's id -> the id of the parameter it stood in for (bound again once the call returned)."""
    ids = {}
    for i, (module, name, t) in calls.stand_ins.items():
        param = module._parameters.get(name)
        if isinstance(param, torch.Tensor) and param is not t:
            ids[i] = id(param)
    return ids


def own_class(module: nn.Module) -> type:
    """The module's own class: FSDP2 swaps it for a subclass `FSDP<Name>(FSDPModule, <Name>)`."""
    cls = type(module)
    bases = cls.__bases__
    if len(bases) == 2 and bases[0].__name__ == "FSDPModule" and cls.__name__ == f"FSDP{bases[1].__name__}":
        return bases[1]
    return cls


def _contains(outer: nn.Module, inner: nn.Module) -> bool:
    return outer is not inner and any(m is inner for m in outer.modules())


def model_path(model: nn.Module) -> str:
    return str(getattr(model, "name_or_path", "") or getattr(getattr(model, "config", None), "_name_or_path", ""))


def walk_graph(loss: torch.Tensor) -> dict:
    """Every node of the loss's autograd graph once: its trainable leaves, and the tensors each node saved."""
    params, saved, nodes = [], [], []
    order: dict[int, int] = {}
    queue = [loss.grad_fn]
    while queue:
        node = queue.pop(0)
        if node is None or id(node) in order:
            continue
        order[id(node)] = len(nodes)
        name = type(node).__name__
        entry_ = {"name": name, "next": []}
        nodes.append(entry_)
        variable = getattr(node, "variable", None)
        if isinstance(variable, torch.Tensor):
            params.append(variable)
        for attr in dir(node):
            if not attr.startswith("_saved_"):
                continue
            try:
                value = getattr(node, attr)
            except RuntimeError:  # freed, or not a tensor attribute of this node
                continue
            for suffix, t in _tensors(value):
                saved.append((len(nodes) - 1, attr[len("_saved_"):] + suffix, t))
        for child, _ in node.next_functions:
            if child is not None:
                queue.append(child)
                entry_["next"].append(id(child))
    for entry_ in nodes:
        entry_["next"] = [order[c] for c in entry_["next"] if c in order]
    return {"params": params, "saved": saved, "nodes": nodes, "node_ids": order}


def drafter_interior(graph: dict, draft_logits: list[torch.Tensor], vocab: int | None) -> set[int]:
    """The nodes that compute the draft logits (reachable from them): the drafter's own graph. The rest, between
    them and the loss, is the loss side, whose saved tensors are recorded. Without a head seen, the boundary is
    each node that saved a vocabulary-wide tensor carrying gradient (the draft log-probabilities)."""
    index = graph["node_ids"]
    starts = [index[id(t.grad_fn)] for t in draft_logits if t.grad_fn is not None and id(t.grad_fn) in index]
    if not starts:
        for node_index, _, t in graph["saved"]:
            if t.requires_grad and vocab is not None and t.dim() and t.shape[-1] == vocab:
                starts.extend(graph["nodes"][node_index]["next"])
    seen: set[int] = set()
    stack = list(starts)
    while stack:
        i = stack.pop()
        if i in seen:
            continue
        seen.add(i)
        stack.extend(graph["nodes"][i]["next"])
    return seen


def is_target_head_copy(module: nn.Module, target: nn.Module) -> bool:
    """A frozen linear equal by value to the target's output head: the target's head, wherever it was loaded."""
    head = target.get_output_embeddings()
    weight = getattr(module, "weight", None)
    if not (isinstance(weight, torch.Tensor) and not weight.requires_grad and head is not None
            and weight.shape == head.weight.shape and weight.dtype == head.weight.dtype):
        return False
    mine, theirs = local_value(weight.detach()), head.weight.detach()
    if callable(getattr(weight, "to_local", None)):  # sharded: this rank's shard against the head's rows there
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        shape, offset = compute_local_shape_and_global_offset(weight.shape, weight.device_mesh, weight.placements)
        theirs = local_value(theirs)[tuple(slice(o, o + n) for o, n in zip(offset, shape))]
    return mine.device == theirs.device and mine.shape == theirs.shape and bool(torch.equal(mine, theirs))


def _placement(module: nn.Module) -> list[str]:
    return sorted({str(p.device) for p in module.parameters()} | {str(b.device) for b in module.buffers()})


def _config_facts(module: nn.Module) -> dict:
    config = getattr(module, "config", None)
    facts = {}
    if config is not None:
        nested = getattr(config, "dflash_config", None) or {}
        for name in ("num_hidden_layers", "num_target_layers", "hidden_size", "vocab_size", "block_size",
                     "mask_token_id", "target_layer_ids", "aux_hidden_state_layer_ids", "pad_token_id",
                     "sample_from_anchor"):
            value = nested.get(name, getattr(config, name, None)) if isinstance(nested, dict) else \
                getattr(config, name, None)
            if value is not None:
                facts[name] = list(value) if isinstance(value, (list, tuple)) else value
    for name in ("block_size", "mask_token_id", "target_layer_ids"):
        value = getattr(module, name, None)
        if name not in facts and isinstance(value, (int, list, tuple)):
            facts[name] = list(value) if isinstance(value, (list, tuple)) else value
    return facts


ATTENTION_PROJECTIONS = ({"q_proj", "k_proj", "v_proj"}, {"wq", "wk", "wv"}, {"q", "k", "v"},
                         {"query", "key", "value"}, {"to_q", "to_k", "to_v"})
FUSED_PROJECTIONS = {"qkv_proj", "qkv", "wqkv", "c_attn", "to_qkv"}


def is_attention(module: nn.Module) -> bool:
    """An attention module: its class named *Attention*, or children that are query, key and value projections."""
    if "attention" in type(module).__name__.lower():
        return True
    children = {name.lower() for name, child in module.named_children() if isinstance(child, nn.Linear)}
    return bool(children & FUSED_PROJECTIONS) or any(names <= children for names in ATTENTION_PROJECTIONS)


def depth_from_modules(module: nn.Module) -> tuple[int, str] | None:
    """The drafter's depth where it declares none: its one `nn.ModuleList` of trainable blocks of one class, each
    holding an attention (the decoder layers, under whatever name the team gave them), and where it was read.
    None when there is no such list, or several (the depth is then not known)."""
    lists = []
    for name, child in module.named_modules():
        if not isinstance(child, nn.ModuleList) or not len(child) or any(name.startswith(f"{n}.") for n, _ in lists):
            continue
        kinds = {own_class(block) for block in child}
        if len(kinds) == 1 and any(p.requires_grad for p in child.parameters()) and \
                all(any(is_attention(m) for m in block.modules()) for block in child):
            lists.append((name, child))
    if len(lists) != 1:
        return None
    name, blocks = lists[0]
    return len(blocks), (f"the drafter's modules: {name}, an nn.ModuleList of {len(blocks)} "
                         f"{own_class(blocks[0]).__name__}, each with an attention")


def drafter_meta(drafter: nn.Module, drafter_name: str, trainable_in_loss: int) -> dict:
    """What the recording says of the drafter: its class, placement, declared facts, and its depth read from its
    modules where its config declares none (`depth_from` says where)."""
    facts = _config_facts(drafter)
    meta = {"class": drafter_name, "placement": _placement(drafter), "facts": facts,
            "trainable_in_loss": trainable_in_loss}
    if "num_hidden_layers" not in facts:
        found = depth_from_modules(drafter)
        if found is not None:
            facts["num_hidden_layers"], meta["depth_from"] = found
    return meta


def step_record(loss, graph, calls: StepCalls, drafter: nn.Module, drafter_name: str, target: nn.Module,
                target_calls: list[ModelCall], step_no: int) -> dict:
    """What one step is recorded as: {tensors: {name: cpu tensor}, meta: {...}} (recording.py writes it)."""
    tensors: dict[str, torch.Tensor] = {}
    meta: dict = {"step": step_no, "loss": float(loss.detach().float()), "entries": {}}
    kept: dict[tuple, str] = {}

    def keep(name: str, t: torch.Tensor, role: str, **extra) -> str:
        key = _key(t)
        if key in kept:
            return kept[key]
        kept[key] = name
        tensors[name] = t.detach().to("cpu", copy=True).contiguous()
        meta["entries"][name] = {"role": role, "shape": list(t.shape), "dtype": str(t.dtype).replace("torch.", ""),
                                 "device": str(t.device), **extra}
        return name

    owned = {id(m): n for n, m in drafter.named_modules()}
    target_modules = {id(m) for m in target.modules()} - set(owned)  # a drafter inside the target is not the target
    skip = {_key(p) for m in (drafter, target) for p in (*m.parameters(), *m.buffers())} | \
        {_key(t) for _, _, t in calls.stand_ins.values()}
    for i, call in enumerate(target_calls):
        keep(f"tokens.{i}", call.input_ids, "tokens", **({"packed_start": call.packed[0], "packed_length":
                                                          call.packed[1]} if call.packed else {}))
        if call.attention_mask is not None:
            keep(f"attention_mask.{i}", call.attention_mask, "target_attention_mask")
        if isinstance(call.position_ids, torch.Tensor):
            keep(f"target_positions.{i}", call.position_ids, "target_position_ids")
    fed_names: dict[tuple, str] = {}
    for module, t, call in calls.fed:
        if id(module) in owned and _key(t) not in skip:
            fed_names[_key(t)] = keep(f"fed.{len(kept)}", t, "drafter_input", module=owned[id(module)] or
                                      "(the drafter)", module_class=type(module).__name__, call=call)
    drafter_calls = {id(drafter)} | {id(m) for m, _, _, _ in calls.kwargs if unwrap(m) is drafter}
    kwarg_calls = sorted({call for module, _, _, call in calls.kwargs if id(module) in drafter_calls})
    for module, name, t, call in calls.kwargs:
        if id(module) in drafter_calls:
            tag = f"{kwarg_calls.index(call)}." if len(kwarg_calls) > 1 else ""
            keep(f"drafter_kwarg.{tag}{name}", t, "drafter_kwarg", kwarg=name, call=call)
    inside_target = {id(target)}
    for i, (module, ids, out, enclosing, out_key) in enumerate(calls.embeds):
        if inside_target & set(enclosing) and out_key not in fed_names:
            continue  # the target's own embedding; one inside its call that the drafter consumed is the block's
        keep(f"embed_ids.{i}", ids, "embedding_ids", module="target" if id(module) in target_modules else
             owned.get(id(module), type(module).__name__), output_shape=list(out),
             consumed_as=fed_names.get(out_key))
    vocab = getattr(target.config, "vocab_size", None)
    for i, (module, out, call) in enumerate(calls.heads):
        if id(module) not in owned and is_target_head_copy(module, target):
            target_modules.add(id(module))  # the target's head loaded apart (SpecForge's TargetEmbeddingsAndHead)
        # A frozen head outside the drafter whose output carries the drafter's gradient: the causal LM's head where the
        # target recorded is its decoder stack run on its own (its head is no module of that stack).
        borrowed = id(module) not in owned and not any(p.requires_grad for p in module.parameters())
        if borrowed and id(module) not in target_modules and is_decoder_like(target):
            target_modules.add(id(module))
        if out.shape[-1] == vocab and (id(module) in owned or id(module) in target_modules):
            keep(f"draft_logits.{i}", out, "draft_logits",
                 module="target.lm_head" if id(module) in target_modules else owned[id(module)], call=call)
    interior = drafter_interior(graph, [out for _, out, _ in calls.heads if out.shape[-1] == vocab], vocab)
    log_probs: dict[str, torch.Tensor] = {}
    for node_index, attr, t in graph["saved"]:
        if node_index in interior or _key(t) in skip:
            continue
        node = graph["nodes"][node_index]["name"]
        if t.requires_grad:
            if vocab is not None and t.dim() and t.shape[-1] == vocab:
                name = keep(f"loss_draft.{node_index}.{attr}", t, "loss_draft_side", node=node,
                            node_index=node_index, attr=attr)
                if node.startswith("LogSoftmax") and attr == "result":
                    log_probs[name] = t
            continue
        keep(f"loss_input.{node_index}.{attr}", t, "loss_input", node=node, node_index=node_index, attr=attr)
    # The loss's gradient on the draft log-probabilities: for KL or cross-entropy toward any target p, row r's is
    # -c_r * p_r, so it gives each row's weight in the loss (c_r, reduction included) and the distribution it is
    # trained toward, whatever code computed them (the real backward still runs afterwards: retain_graph).
    if log_probs:
        try:
            grads = torch.autograd.grad(loss, list(log_probs.values()), retain_graph=True, allow_unused=True)
        except RuntimeError:
            grads = ()
        for (name, t), g in zip(log_probs.items(), grads):
            if g is not None:
                keep(f"loss_grad.{name}", g, "loss_gradient", of=name)
    meta["graph"] = [{"index": i, "name": n["name"], "next": [c for c in n["next"] if c not in interior]}
                     for i, n in enumerate(graph["nodes"]) if i not in interior]
    meta["graph_nodes"] = len(graph["nodes"])
    meta["drafter"] = drafter_meta(drafter, drafter_name, len(graph["params"]))
    meta["target"] = {"path": model_path(target), "class": type(target).__qualname__,
                      "placement": _placement(target), "facts": _config_facts(target),
                      "dtype": str(next(target.parameters()).dtype).replace("torch.", ""),
                      "layers_placement": [_placement(layer) for layer in target.get_decoder().layers]}
    return {"tensors": tensors, "meta": meta}


def step_hook(loss) -> None:
    """`trace.step` under the tool: the installed recorder records the step (installed now if the bootstrap did
    not run, which it then reports: this step's forward was not seen)."""
    if not INSTALLED:
        install_from_env(late=True)
    INSTALLED[0].step(loss)


def install_from_env(late: bool = False) -> Recorder:
    """The recorder of the traced command's process, from the options the verb set (RecorderOptions)."""
    recorder = Recorder.from_options(RecorderOptions.from_environment(), late=late, own_process=True)
    recorder.install()
    import atexit

    atexit.register(recorder.finish)  # a step still open when the script ends (no optimizer, --steps 0) is written
    mark(Mark.INSTALLED)
    return recorder


def tau_hook(tau) -> None:
    """`trace.tau` under the tool: the evaluator's own τ, kept with its evaluation."""
    from dflash_audit.trace.evaluation.recorder import tau_value

    if not INSTALLED:
        install_from_env(late=True)
    if INSTALLED[0].evaluation is not None:
        INSTALLED[0].evaluation.tau = tau_value(tau)

"""What the run does across steps, recorded beside the step recorder (recorder.py), read from the objects themselves:
no line in the script, no name of the script's.

- the optimizers: every `torch.optim.Optimizer` made after the recorder was installed (its `__init__` is counted by
  the recorder) and every one torch's global optimizer step hooks report; their classes, their parameter groups
  (every setting: lr, betas, momentum, eps, weight decay, ...) and which of the drafter's parameters each holds;
- the learning rate of every group at every optimizer step (read at the step's first optimizer `step()`, before it
  applies: the lr this step uses), and the schedulers made (their class, their state, transformers' declared warmup
  and total when their lambdas say so);
- the gradient norm after the step's last backward and at its optimizer step (the clipping between them, whoever did
  it), and each `clip_grad_norm_` call with its max norm;
- the backwards per optimizer step, the loss each backward was given, whether the parameters moved since the previous
  step, the dtypes of the parameters, their gradients and the optimizer state, and the autocast the drafter ran under;
- resume: the optimizer's state step and the schedulers' last epoch at the first step, and which states were loaded;
- under torchrun, a digest of the token ids each rank embedded at each step (gathered to rank 0), so that ranks fed
  the same batch are seen.
The whole of it is small JSON, written in the manifest's context (`run`); the audit is run/audit.py.
"""

from __future__ import annotations

import functools
import hashlib
import math
import weakref
from collections import Counter

import torch
from torch import nn

from dflash_audit.trace.record.hooks import HOOKS, Observer
from dflash_audit.trace.record.sharded import nonzero_count, square_sum, whole_sums, whole_value
from dflash_audit.trace.run.parity_capture import BatchCapture

# Group settings recorded as they are (JSON-able scalars and tuples); the parameters themselves are named apart.
SKIP_GROUP_KEYS = ("params", "param_names")


def _plain(value):
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    if isinstance(value, (tuple, list)) and all(isinstance(v, (bool, int, float)) for v in value):
        return list(value)
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return float(value)
    return None


def _class_name(obj) -> str:
    return f"{type(obj).__module__}:{type(obj).__qualname__}"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _dtype(t: torch.Tensor) -> str:
    return _dtype_name(t.dtype)


def _norm(square_sums: list[list[float] | None]) -> float | None:
    """The 2-norm of tensors together from each one's whole sum of squares (`whole_sums`); None where one is
    unknown, or where there are none."""
    if not square_sums or None in square_sums:
        return None
    return math.sqrt(sum(s[0] for s in square_sums))


class RunRecorder(Observer):
    """Installed by the step recorder (`Recorder.install`), which calls `step_facts` at each optimizer step."""

    def __init__(self, recorder, parity: int = 0):
        self.recorder = recorder
        self.parity = parity  # steps whose weights and gradients are kept for the step parity (run/parity.py)
        self.parity_steps: list[dict] = []
        self.parity_unavailable: str | None = None  # why the parity's tensors could not be kept whole (sharded)
        self.parity_batches: list[dict | None] = []
        self.batches = BatchCapture()  # each parity step's batch, when the drafter is speculators' model
        self.raw_grads: dict = {}
        self.optimizers: list[weakref.ref] = []
        self.schedulers: list[weakref.ref] = []
        self.loaded: Counter = Counter()  # which kinds of state were loaded (optimizer, scheduler)
        self.clip_calls: list[dict] = []
        self.steps: list[dict] = []
        self.structure: dict | None = None
        self.backwards = 0
        self.losses: list[float] = []
        self.norm_after_backward: float | None = None
        self.embedded: list[str] = []  # digests of the token ids embedded since the step began
        self.autocast: set[tuple] = set()
        self.previous_sums: dict[int, tuple[float, float] | None] = {}
        self.in_step = False  # the step's first optimizer step() was seen; the next backward opens another

    # -- installing ----------------------------------------------------------------------------------------------
    def install(self) -> RunRecorder:
        """Added to the process's hooks (record/hooks.py) after the step recorder, with the parity's capture."""
        HOOKS.add(self)
        if self.parity:
            HOOKS.add(self.batches)
        return self

    def remove(self) -> None:
        HOOKS.discard(self.batches)
        HOOKS.discard(self)

    def optimizer_made(self, optimizer) -> None:
        self._know_optimizer(optimizer)

    def optimizer_loading(self, optimizer) -> None:
        self.loaded["optimizer"] += 1

    def scheduler_made(self, scheduler) -> None:
        self.schedulers.append(weakref.ref(scheduler))

    def scheduler_loading(self, scheduler) -> None:
        self.loaded["scheduler"] += 1

    def clipped(self, max_norm, norm_type, total) -> None:
        self.clip_calls.append({"max_norm": float(max_norm), "norm_type": float(norm_type),
                                "total_norm": float(total)})

    def _know_optimizer(self, optimizer) -> None:
        if not any(ref() is optimizer for ref in self.optimizers):
            self.optimizers.append(weakref.ref(optimizer))

    def live_optimizers(self) -> list:
        return [o for o in (ref() for ref in self.optimizers) if o is not None and o.param_groups]

    # -- what flows through a step -------------------------------------------------------------------------------
    def forward_enter(self, module, args) -> None:
        if isinstance(module, nn.Embedding) and args and isinstance(args[0], torch.Tensor):
            ids = args[0].detach()
            self.embedded.append(hashlib.sha1(ids.to("cpu").contiguous().numpy().tobytes()).hexdigest()[:16])
        elif self.recorder.trainable_depth == 1 and self.recorder._kind(module)[3]:
            # The outermost call of a module holding trainable weights (the step recorder's hook ran first): the
            # autocast the drafter's forward runs under.
            device = next((p.device.type for p in module.parameters()), "cpu")
            enabled = torch.is_autocast_enabled(device)
            self.autocast.add((device, enabled, _dtype_name(torch.get_autocast_dtype(device)) if enabled else None))
            if self._keeping_parity() and len(self.parity_steps) <= self.parity:
                self.batches.enter(module)

    def backward_ended(self, tensors) -> None:
        loss = tensors if isinstance(tensors, torch.Tensor) else None
        if loss is None or loss.numel() != 1 or not loss.is_floating_point():
            return
        if loss.grad_fn is None:
            return
        params = self._params()
        if self.in_step:  # the previous step's optimizer has stepped: this backward opens a new step
            self.in_step = False
        self.backwards += 1
        self.losses.append(float(loss.detach().float()))
        self.norm_after_backward = self._grad_norm(params)
        if self._keeping_parity() and len(self.parity_steps) < self.parity:  # the gradient before any clipping
            self.raw_grads = self._parity_copies({name: p.grad for name, p in self._trained() if p.grad is not None})

    def _keeping_parity(self) -> bool:
        return bool(self.parity) and self.parity_unavailable is None

    def _parity_copies(self, named: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """CPU copies of the step parity's tensors (rank 0 only: the drafter is found there). One held in shards
        across ranks (FSDP2) cannot be copied whole without a collective of this rank's alone: the parity is then
        unavailable, and says why, rather than compare a shard as the whole."""
        copies = {}
        for name, t in named.items():
            whole = whole_value(t.detach())
            if whole is None:
                self.parity_unavailable = (f"the drafter's weights are held in shards across ranks (FSDP2; {name} "
                                           "first), and rank 0, which records, holds its own shard only")
                self.parity_steps, self.parity_batches, self.raw_grads = [], [], {}
                return {}
            copies[name] = whole.to("cpu", copy=True)
        return copies

    def _params(self) -> list[torch.Tensor]:
        seen, params = set(), []
        for optimizer in self.live_optimizers():
            for group in optimizer.param_groups:
                for p in group["params"]:
                    if id(p) not in seen:
                        seen.add(id(p))
                        params.append(p)
        return params

    @staticmethod
    def _grad_norm(params) -> float | None:
        """The 2-norm of every gradient together; a sharded one's (FSDP2) over the whole parameter (sharded.py)."""
        return _norm(whole_sums([p.grad.detach().float() for p in params if p.grad is not None], (square_sum,)))

    # -- the optimizer step: one step's facts ---------------------------------------------------------------------
    def step_facts(self, optimizer) -> None:
        """The step's facts as its optimizer is about to apply: called by the step recorder (its `optimizer_step`,
        torch's global optimizer step pre-hook), before it closes the step."""
        self._know_optimizer(optimizer)
        if self.in_step or (not self.backwards and not self.losses):
            return  # the step's second optimizer (Muon, then AdamW), or a step with no backward seen
        self.in_step = True
        params = self._params()
        names = self._names()
        if self.structure is None:
            self.structure = self._structure(names)
        # Each parameter's sum and sum of squares, a sharded one's over the whole parameter: on every rank, the
        # same collectives in the same order (the optimizer's parameters), none on one rank alone (sharded.py).
        sums = {id(p): (tuple(s) if s is not None else None)
                for p, s in zip(params, whole_sums(params, (torch.sum, square_sum)))}
        moved = None
        if self.previous_sums and None not in sums.values() and None not in self.previous_sums.values():
            moved = sum(1 for key, value in sums.items() if key in self.previous_sums and
                        self.previous_sums[key] != value)
        self.previous_sums = sums
        grads = [p.grad for p in params if p.grad is not None]
        # The gradient's norm and its nonzero counts in one call: one all-reduce per mesh, not two, when sharded.
        grad_sums = whole_sums([g.detach().float() for g in grads], (square_sum, nonzero_count))
        norm_at_step = _norm([None if sums is None else sums[:1] for sums in grad_sums])
        step = {
            "backwards": self.backwards, "loss": sum(self.losses) if self.losses else None,
            "losses": list(self.losses),
            "grad_norm_after_backward": self.norm_after_backward, "grad_norm_at_step": norm_at_step,
            "clip_calls": list(self.clip_calls),
            "zero_gradients": bool(grads) and all(r is not None and r[1] == 0 for r in grad_sums),
            "params_with_grad": len(grads), "params": len(params),
            "params_moved": moved,
            "lrs": [[_plain(group.get("lr")) for group in o.param_groups] for o in self.live_optimizers()],
            "initial_lrs": [[_plain(group.get("initial_lr")) for group in o.param_groups]
                            for o in self.live_optimizers()],
            "dtypes": {"params": sorted({_dtype(p) for p in params}), "grads": sorted({_dtype(g) for g in grads}),
                       "optimizer_state": sorted({_dtype(v) for o in self.live_optimizers() for s in o.state.values()
                                                  for v in s.values() if isinstance(v, torch.Tensor) and v.dim()})},
            "autocast": sorted([list(a) for a in self.autocast], key=str),
            "schedulers": [self._scheduler_facts(s) for s in (ref() for ref in self.schedulers) if s is not None],
            "optimizer_state_steps": [self._state_step(o) for o in self.live_optimizers()],
            "optimizer_states": [len(o.state) for o in self.live_optimizers()],
            "loaded": dict(self.loaded),
            "ranks_embedded": self._gather(hashlib.sha1("".join(self.embedded).encode()).hexdigest()[:16]
                                           if self.embedded else None),
        }
        self.steps.append(step)
        if self._keeping_parity() and len(self.parity_steps) <= self.parity:
            trained = self._trained()  # the weights this step starts from, its gradients
            kept = {"param": self._parity_copies(dict(trained)),
                    "grad": self._parity_copies({name: p.grad for name, p in trained if p.grad is not None}),
                    "raw": self.raw_grads}
            if self._keeping_parity():
                self.parity_steps.append(kept)
                self.parity_batches.append(self.batches.take())
            self.raw_grads = {}
        self.backwards, self.losses, self.clip_calls, self.embedded = 0, [], [], []
        self.autocast = set()
        self.norm_after_backward = None

    def _drafter(self) -> nn.Module | None:
        """The drafter the step recorder found (rank 0 only)."""
        pending = self.recorder.pending
        if isinstance(pending, dict) and pending.get("parts"):
            return pending["parts"][0]
        if self.recorder.recorded:
            return self.recorder.recorded[-1].get("parts", (None,))[0]
        return None

    def _trained(self) -> list[tuple[str, torch.Tensor]]:
        """The drafter's trained weights by name: its parameters, or the tensors a functional call trained in
        their places (`drafter_weights`)."""
        drafter = self._drafter()
        return drafter_weights(drafter, self.recorder.stand_ins) if drafter is not None else []

    def _names(self) -> dict[int, str]:
        """Each trained parameter's name in the drafter, where the step recorder found it."""
        drafter = self._drafter()
        return weight_names(drafter, self.recorder.stand_ins) if drafter is not None else {}

    def _structure(self, names: dict[int, str]) -> dict:
        optimizers = []
        placed = set()
        for o in self.live_optimizers():
            groups = []
            for group in o.param_groups:
                settings = {k: _plain(v) for k, v in group.items() if k not in SKIP_GROUP_KEYS}
                params = [{"name": names.get(id(p), "(outside the drafter)"), "shape": list(p.shape)}
                          for p in group["params"]]
                placed.update(id(p) for p in group["params"])
                groups.append({"settings": {k: v for k, v in settings.items() if v is not None}, "params": params})
            optimizers.append({"class": _class_name(o), "groups": groups})
        trainable = self._trained()
        return {"optimizers": optimizers, "drafter_trainable": len(trainable),
                "not_in_any_optimizer": [n for n, p in trainable if id(p) not in placed]}

    @staticmethod
    def _scheduler_facts(scheduler) -> dict:
        facts = {"class": _class_name(scheduler), "last_epoch": int(getattr(scheduler, "last_epoch", -1)),
                 "optimizer": _class_name(getattr(scheduler, "optimizer", None))}
        declared = []
        for fn in getattr(scheduler, "lr_lambdas", []) or []:
            if isinstance(fn, functools.partial):  # transformers' schedules: the lambda's own keywords
                declared.append({"function": getattr(fn.func, "__qualname__", str(fn.func)),
                                 **{k: _plain(v) for k, v in fn.keywords.items()}})
        if declared:
            facts["declared"] = declared
        return facts

    @staticmethod
    def _state_step(optimizer) -> int:
        steps = [_plain(s.get("step")) for s in optimizer.state.values() if isinstance(s, dict) and "step" in s]
        return int(max(steps)) if steps else 0

    def _gather(self, digest: str | None) -> list | None:
        """Every rank's digest of what it embedded this step (torchrun): gathered to every rank."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
            return None
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, digest)
        return gathered

    def facts(self, out=None) -> dict:
        facts = {"structure": self.structure, "steps": self.steps}
        if self.parity_unavailable is not None:
            facts["parity"] = {"unavailable": self.parity_unavailable}
        elif self.parity_steps and out is not None:
            from pathlib import Path

            from safetensors.torch import save_file

            from dflash_audit.trace.record.recording import PARITY
            from foundation.atomic import atomic_write_bytes

            tensors = {f"step{k}/{kind}/{name}": t.contiguous() for k, step in enumerate(self.parity_steps)
                       for kind, named in step.items() for name, t in named.items()}
            batches = []  # each step's batch as speculators' model took it (run/parity_capture.py)
            for k, batch in enumerate(self.parity_batches):
                if batch is None:
                    batches.append(None)
                    continue
                tensors.update({f"step{k}/batch/{name}": t.contiguous() for name, t in batch["tensors"].items()})
                tensors[f"step{k}/rng/cpu"] = batch["rng"]
                if batch["device_rng"] is not None:
                    tensors[f"step{k}/rng/device"] = batch["device_rng"]
                if batch["logits"] is not None:
                    tensors[f"step{k}/out/logits"] = batch["logits"].contiguous()
                batches.append({"settings": batch["settings"], "loss": batch["loss"], "device": batch["device"]})
            model = self.batches.model
            if model is not None:
                tensors.update({f"model/untrained/{name}": t.contiguous() for name, t in model["untrained"].items()})
            atomic_write_bytes(Path(out) / PARITY, lambda tmp: save_file(tensors, tmp,
                                                                         metadata={"schema": "dflash-audit/trace-parity/1"}))
            facts["parity"] = {"file": PARITY, "steps": len(self.parity_steps), "batches": batches,
                               "model": {k: v for k, v in model.items() if k != "untrained"} if model else None,
                               "other_drafter": self.batches.other}
        return facts


def drafter_weights(drafter: nn.Module, stand_ins: dict[int, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    """The drafter's trained weights by name, as the step trains them: each parameter, or the tensor that stood in
    for it in the step's calls (`Recorder.stand_ins`); those that require grad."""
    named = ((name, stand_ins.get(id(p), p)) for name, p in drafter.named_parameters())
    return [(name, w) for name, w in named if w.requires_grad]


def weight_names(drafter: nn.Module, stand_ins: dict[int, torch.Tensor]) -> dict[int, str]:
    """id -> name of each drafter parameter and of each tensor that stood in for one."""
    names = {}
    for name, p in drafter.named_parameters():
        names[id(p)] = name
        if id(p) in stand_ins:
            names[id(stand_ins[id(p)])] = name
    return names

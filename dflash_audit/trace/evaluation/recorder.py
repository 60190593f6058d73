"""What a team's own evaluator did, recorded call by call with no line in it: the target's calls, the calls of
every module fed a tensor as wide as the target's features (the drafter among them: which one is decided by value
in the audit), and the head calls that turn a drafter's output into logits. Written beside the trainer's recording
as `evaluation.safetensors` + `evaluation.json` (atomically, the manifest last with the tensor file's size and hash).

A run is an evaluation when it ends with no training step (no `backward()` of a loss reaching a trainable
parameter, no `trace.step`), or when `--eval` says so. A trainer's validation loop is not one: the first training
step drops whatever was captured before it (dflash_audit/trace/record/recorder.py).

Only calls from no other module (a root call) are read, each copied to the CPU when it ends, since an evaluator
reuses and edits its buffers in place between rounds. The target's logits are kept as their top two (argmax and
margin): the audit needs the target's choice at each verified position, not its distribution.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from dflash_audit.trace.record.hooks import Observer
from dflash_audit.trace.record.recording import check_tensors_file, file_sha256
from dflash_audit.trace.record.sharded import whole_value
from foundation.atomic import atomic_write_bytes
from foundation.errors import AuditError
from foundation.transformers_compat import passed_cache

FORMAT = 1
SCHEMA = f"dflash-audit/trace-evaluation/{FORMAT}"
MANIFEST = "evaluation.json"
TENSORS = "evaluation.safetensors"
OWN_FILES = (MANIFEST, TENSORS)


def _fingerprint(t: torch.Tensor) -> list:
    """A parameter's identity by value, cheap to compare with a file's tensor: shape, sum, sum of squares. A tensor
    this rank holds a shard of (FSDP2) has its shape only: its sums are unknown here (the rest is on other ranks,
    and no collective is issued from one rank alone: record/sharded.py)."""
    whole = whole_value(t)
    if whole is None:
        return [list(t.shape), None, None]
    f = whole.detach().double()
    return [list(t.shape), float(f.sum()), float((f * f).sum())]


def _weights(module: nn.Module):
    """The module's parameters and persistent buffers under the names its `state_dict()` gives them, read without
    calling it: `state_dict()` runs the module's hooks, and FSDP2's reshard the module (on this rank alone, whose
    next all-gather then pairs with another rank's different one)."""
    for prefix, m in module.named_modules(remove_duplicate=False):
        dot = f"{prefix}." if prefix else ""
        for name, p in m._parameters.items():
            if p is not None:
                yield dot + name, p
        for name, b in m._buffers.items():
            if b is not None and name not in m._non_persistent_buffers_set:
                yield dot + name, b


def _config_facts(module: nn.Module) -> dict:
    config = getattr(module, "config", None)
    facts = {}
    for name in ("block_size", "mask_token_id", "target_layer_ids", "sliding_window", "layer_types",
                 "num_hidden_layers", "hidden_size"):
        value = getattr(module, name, None)
        if value is None and config is not None:
            nested = getattr(config, "dflash_config", None)
            value = nested.get(name) if isinstance(nested, dict) and name in nested else getattr(config, name, None)
        if isinstance(value, (int, float, str, bool)) or (isinstance(value, (list, tuple)) and all(
                isinstance(v, (int, str)) for v in value)):
            facts[name] = list(value) if isinstance(value, (list, tuple)) else value
    return facts


def _path(module: nn.Module) -> str:
    return str(getattr(module, "name_or_path", "") or getattr(getattr(module, "config", None), "_name_or_path", "")
               or "")


def _first_tensor(output):
    if isinstance(output, torch.Tensor):
        return output
    for name in ("logits", "last_hidden_state"):
        value = getattr(output, name, None)
        if isinstance(value, torch.Tensor):
            return value
    if isinstance(output, (list, tuple)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    return None


def _cpu(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu", copy=True).contiguous()


class EvaluationCapture(Observer):
    """The evaluator's root calls, in order, each as {kind, module, ...} plus its tensors (copied). Added to the
    process's hooks after the step recorder (record/hooks.py), whose reading of each module it shares:
    `is_target_like(module)`, `enclosing` (the module calls in progress, the ending one taken off), and `began()`,
    called at a drafter's call (an evaluation's round: the command is under way)."""

    def __init__(self, is_target_like: Callable[[nn.Module], bool], enclosing: list[nn.Module],
                 began: Callable[[], None]) -> None:
        self.is_target_like = is_target_like
        self.enclosing = enclosing
        self.began = began
        self.events: list[dict] = []
        self.tensors: dict[str, torch.Tensor] = {}
        self.modules: dict[int, dict] = {}  # id(module) -> {"index", "class", "path", "facts", "fingerprints"}
        self.module_refs: dict[int, nn.Module] = {}
        self.target: nn.Module | None = None
        self.target_parts: set[int] = set()
        self.hidden_size: int | None = None
        self.vocab: int | None = None
        self.tau = None  # what `trace.tau(...)` handed over
        self.apart: dict[int, bool] = {}

    # -- the calls ---------------------------------------------------------------------------------------------
    def forward_leave(self, module, args, kwargs: dict, output) -> None:
        self.call(module, args, kwargs, output, self.is_target_like(module), self.enclosing, self.is_target_like)
        if self.events and self.events[-1]["kind"] == "drafter":
            self.began()

    def call(self, module: nn.Module, args, kwargs, output, target_like: bool, enclosing: list[nn.Module],
             is_target_like) -> None:
        """One module call ending. Read: a target's call not inside another target call; the outermost call of a
        module with weights that does not hold the target (an evaluator's own nn.Module around the loop is passed
        through); a head call (a vocabulary-wide output) outside them."""
        if target_like:
            if not any(is_target_like(m) for m in enclosing) and (self.target is None or module is self.target):
                self._target_call(module, args, kwargs, output)
            return
        if self.target is None or any(is_target_like(m) or self._holds_weights_apart(m) for m in enclosing):
            return
        out = _first_tensor(output)
        vocab_wide = isinstance(out, torch.Tensor) and out.is_floating_point() and out.dim() >= 2 \
            and out.shape[-1] == self.vocab
        if vocab_wide and (isinstance(module, nn.Linear) or id(module) in self.target_parts):
            self._head_call(out)
            return
        if id(module) in self.target_parts or not self._holds_weights_apart(module):
            return
        inputs = [(f"arg{i}", t) for i, t in enumerate(args) if isinstance(t, torch.Tensor)]
        inputs += [(name, t) for name, t in kwargs.items() if isinstance(t, torch.Tensor)]
        if not any(t.is_floating_point() and t.dim() >= 2 and t.shape[-1] % self.hidden_size == 0 for _, t in inputs):
            return  # fed nothing as wide as the target's features: not a drafter candidate
        self._drafter_call(module, inputs, out, vocab_wide)

    def _holds_weights_apart(self, module: nn.Module) -> bool:
        """A module with weights of its own that does not hold the target (a drafter candidate)."""
        known = self.apart.get(id(module))
        if known is None:
            known = id(module) not in self.target_parts and any(True for _ in module.parameters()) and not any(
                m is self.target for m in module.modules())
            self.apart[id(module)] = known
        return known

    def _module(self, module: nn.Module) -> int:
        entry = self.modules.get(id(module))
        if entry is None:
            entry = {"index": len(self.modules), "class": f"{type(module).__module__}:{type(module).__qualname__}",
                     "path": _path(module), "facts": _config_facts(module),
                     "fingerprints": {n: _fingerprint(p) for n, p in _weights(module)
                                      if isinstance(p, torch.Tensor) and p.is_floating_point()}}
            self.modules[id(module)] = entry
            self.module_refs[id(module)] = module
        return entry["index"]

    def _keep(self, name: str, t: torch.Tensor) -> str:
        key = f"e{len(self.events)}.{name}"
        self.tensors[key] = _cpu(t)
        return key

    def _target_call(self, module, args, kwargs, output) -> None:
        if self.target is None:
            config = module.config
            hidden, vocab = getattr(config, "hidden_size", None), getattr(config, "vocab_size", None)
            if not isinstance(hidden, int) or not isinstance(vocab, int):
                return  # no causal LM's config (speculators' DFlashDraftModel has a head and layers): not a target
            self.target = module
            self.target_parts = {id(m) for m in module.modules()}
            self.hidden_size, self.vocab = hidden, vocab
        ids = kwargs.get("input_ids", args[0] if args and isinstance(args[0], torch.Tensor) else None)
        logits = _first_tensor(output)
        if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or logits is None or logits.shape[-1] != self.vocab:
            return  # a call on embeddings, or without logits: no rounds can be read from it
        event = {"kind": "target", "module": self._module(module)}
        length = ids.shape[1]
        event["ids"] = self._keep("ids", ids)
        event["positions"] = self._keep("positions", self._positions(kwargs, output, ids))
        mask = kwargs.get("attention_mask")
        if isinstance(mask, torch.Tensor) and mask.dim() == 2:
            event["attention_mask"] = self._keep("attention_mask", mask.to(torch.int64))
        kept = logits.shape[1]  # logits_to_keep: the last `kept` positions
        top = logits.detach().float().topk(2, dim=-1)
        event["logits_from"] = length - kept
        event["argmax"] = self._keep("argmax", top.indices[..., 0])
        event["margin"] = self._keep("margin", top.values[..., 0] - top.values[..., 1])
        event["hidden_states"] = bool(getattr(output, "hidden_states", None))
        self.events.append(event)

    @staticmethod
    def _positions(kwargs, output, ids: torch.Tensor) -> torch.Tensor:
        """The positions the target ran the ids at: its position ids, else its cache positions, else after what its
        cache held before the call (as transformers numbers them), else from 0."""
        given = kwargs.get("position_ids")
        if isinstance(given, torch.Tensor):
            return given.expand(ids.shape[0], -1) if given.shape[0] == 1 else given
        cache_position = kwargs.get("cache_position")
        if isinstance(cache_position, torch.Tensor):
            return cache_position.reshape(1, -1).expand(ids.shape[0], -1)
        cache = passed_cache(kwargs, output)
        before = 0
        if cache is not None and hasattr(cache, "get_seq_length"):
            before = max(0, int(cache.get_seq_length()) - ids.shape[1])  # the cache now holds this call's ids too
        return (before + torch.arange(ids.shape[1], device=ids.device)).reshape(1, -1).expand(ids.shape[0], -1)

    def _drafter_call(self, module, inputs, out, vocab_wide: bool) -> None:
        event = {"kind": "drafter", "module": self._module(module), "inputs": {}}
        for name, t in inputs:
            event["inputs"][name] = self._keep(f"in.{name}", t)
        if vocab_wide:  # a drafter whose forward ends in the head: its logits, as a head call's
            top = (out[None] if out.dim() == 2 else out).detach().float().topk(2, dim=-1)
            event["argmax"] = self._keep("argmax", top.indices[..., 0])
            event["margin"] = self._keep("margin", top.values[..., 0] - top.values[..., 1])
        elif isinstance(out, torch.Tensor) and out.is_floating_point():
            event["output"] = self._keep("output", out)
        self.events.append(event)

    def _head_call(self, out) -> None:
        if out.dim() == 2:  # rows without a batch dimension (a team's drafter one prompt at a time)
            out = out[None]
        top = out.detach().float().topk(2, dim=-1)
        self.events.append({"kind": "head", "module": -1, "argmax": self._keep("argmax", top.indices[..., 0]),
                            "margin": self._keep("margin", top.values[..., 0] - top.values[..., 1])})

    # -- the recording -----------------------------------------------------------------------------------------
    def useful(self) -> bool:
        return any(e["kind"] == "target" for e in self.events) and any(e["kind"] == "drafter" for e in self.events)

    def write(self, out: Path, context: dict) -> None:
        from safetensors.torch import save_file

        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(out / TENSORS, lambda tmp: save_file(self.tensors, tmp, metadata={"schema": SCHEMA}))
        target = self.modules.get(id(self.target), {}) if self.target is not None else {}
        manifest = {"schema": SCHEMA, "format": FORMAT, "tensors_file": TENSORS,
                    "tensors_bytes": (out / TENSORS).stat().st_size, "tensors_sha256": file_sha256(out / TENSORS),
                    "context": context, "target": {"path": target.get("path", ""),
                                                   "dtype": str(next(self.target.parameters()).dtype)
                                                   .replace("torch.", "") if self.target is not None else ""},
                    "modules": sorted(self.modules.values(), key=lambda m: m["index"]),
                    "tau": self.tau, "events": self.events}
        text = json.dumps(manifest, indent=1, default=str) + "\n"
        atomic_write_bytes(out / MANIFEST, lambda tmp: Path(tmp).write_text(text))


def tau_value(tau) -> float | list[float]:
    """`trace.tau(tau)`: a number, or one per prompt (a list, a tuple, a 1-D tensor or array)."""
    if hasattr(tau, "tolist"):
        tau = tau.tolist()
    if isinstance(tau, (int, float)) and not isinstance(tau, bool):
        return float(tau)
    if isinstance(tau, (list, tuple)) and tau and all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                                      for v in tau):
        return [float(v) for v in tau]
    raise TypeError(f"trace.tau: give a number or a per-prompt list of numbers, got {type(tau).__name__}")


class EvaluationRecording:
    def __init__(self, folder: Path, manifest: dict, tensors: dict[str, torch.Tensor]):
        self.folder, self.manifest, self.tensors = folder, manifest, tensors

    @property
    def events(self) -> list[dict]:
        return self.manifest["events"]

    def tensor(self, key: str) -> torch.Tensor:
        return self.tensors[key]


def has_evaluation(folder: Path) -> bool:
    return (Path(folder) / MANIFEST).is_file()


def read_evaluation(folder: Path, flag: str = "--from") -> EvaluationRecording:
    """The evaluation recording in `folder`, checked whole (format, size and hash; every tensor it names)."""
    folder = Path(folder)
    path = folder / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise AuditError(f"{flag} {folder}: {MANIFEST} is not readable ({exc})") from None
    except RecursionError:
        raise AuditError(f"{flag} {folder}: {MANIFEST} is nested too deeply to read") from None
    if not isinstance(manifest, dict) or manifest.get("schema") != SCHEMA:
        raise AuditError(f"{flag} {folder}: {MANIFEST} is not a dflash-audit evaluation recording of format {FORMAT} "
                         "(record it again)")
    from dflash_audit.trace.evaluation.manifest import check_manifest, check_tensors

    declared = check_manifest(manifest, f"{flag} {folder}: {MANIFEST}")
    tensors_path = folder / TENSORS
    check_tensors_file(folder, tensors_path, manifest, flag)
    from safetensors.torch import load_file

    tensors = load_file(tensors_path)
    check_tensors(declared, tensors, f"{flag} {folder}")
    return EvaluationRecording(folder, manifest, tensors)


PRINTED = re.compile(r"(?i)(tau|τ|accept)")
NUMBER = re.compile(r"[-+]?\d+\.\d+|[-+]?\d+")


def printed_tau(lines: list[str]) -> dict | None:
    """The τ an evaluator printed: the first decimal number after 'tau', 'τ' or 'accept' on the last line naming
    one (None: no such line)."""
    for line in reversed(lines):
        match = PRINTED.search(line)
        if match is None:
            continue
        numbers = [m for m in NUMBER.finditer(line[match.end():]) if "." in m.group()]
        if numbers:
            return {"value": float(numbers[0].group()), "line": line[:200]}
    return None


def note_printed_tau(out: Path, lines: list[str]) -> None:
    """Kept in the recording's manifest (rewritten atomically; the tensor file and its hash unchanged)."""
    found = printed_tau(lines)
    if found is None:
        return
    path = Path(out) / MANIFEST
    manifest = json.loads(path.read_text())
    manifest["printed_tau"] = found
    text = json.dumps(manifest, indent=1, default=str) + "\n"
    atomic_write_bytes(path, lambda tmp: Path(tmp).write_text(text))

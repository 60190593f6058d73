"""What a training file holds: which entry is the drafter's state dict, what else is in it.

A bare state dict is used as it is. A training dict holds it under an entry (`model`,
`model_state_dict`, `state_dict`, `module`, `drafter`, `draft_model`, `ema`, ...); exactly
one entry may hold one, else the caller must name it (`--ours-entry KEY`). Optimizer,
scheduler, scaler and RNG state are recognized by their structure and only named. Every
other non-tensor entry is a declaration source (training args, configs, hparams).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

ROLE_NAMES = {
    "optimizer state": ("optimizer", "optim", "opt", "optimizer_state", "optimizer_state_dict", "optimizer_states",
                        "optimizers"),
    "scheduler state": ("scheduler", "lr_scheduler", "lr_schedulers", "scheduler_state_dict", "sched", "opt_param_scheduler"),
    "grad-scaler state": ("scaler", "grad_scaler", "amp", "amp_scaler", "scaler_state_dict"),
    # ours: optimizer, scheduler and RNG state and the loss history, under one entry
    "training state": ("training_state",),
    "RNG state": ("rng", "rng_state", "rng_states", "random_state", "torch_rng_state", "cuda_rng_state",
                  "numpy_rng_state", "python_rng_state", "rng_state_dict"),
}


class EntryError(ValueError):
    """The drafter's weights cannot be told apart in the file; names what was found."""


@dataclass
class Payload:
    tensors: dict[str, torch.Tensor]
    entry: str | None  # the entry used; None for a bare state dict
    ignored: dict[str, str] = field(default_factory=dict)  # entry -> role (optimizer state, ...)
    declarations: list[tuple[str, dict[str, Any]]] = field(default_factory=list)  # (entry, plain data)


def tensor_count(value: Any) -> int:
    return sum(isinstance(v, torch.Tensor) for v in value.values()) if isinstance(value, Mapping) else 0


def is_state_dict(value: Any) -> bool:
    """A mapping of names to tensors (a few non-tensor extras tolerated, e.g. a version counter)."""
    if not isinstance(value, Mapping) or not value:
        return False
    tensors = tensor_count(value)
    return tensors > 0 and tensors >= 0.9 * len(value) and all(isinstance(k, str) for k in value)


def role_of(key: str, value: Any) -> str | None:
    """Optimizer/scheduler/scaler/RNG state, by name or by structure."""
    lowered = key.lower()
    for role, names in ROLE_NAMES.items():
        if lowered in names:
            return role
    if isinstance(value, Mapping):
        if "state" in value and "param_groups" in value:
            return "optimizer state"
        if "base_lrs" in value or ("last_epoch" in value and "_step_count" in value):
            return "scheduler state"
        if "growth_factor" in value and "scale" in value:
            return "grad-scaler state"
    if isinstance(value, (list, tuple)) and value and all(
            isinstance(v, Mapping) and role_of(key, v) == "optimizer state" for v in value):
        return "optimizer state"  # e.g. Lightning's `optimizer_states`
    if "rng" in lowered or "random" in lowered:
        return "RNG state"
    return None


def candidates(payload: Mapping) -> dict[str, Mapping]:
    """Entries holding a state dict: top-level ones and one level down (`model.state_dict`)."""
    found: dict[str, Mapping] = {}
    for key, value in payload.items():
        if role_of(str(key), value):
            continue
        if is_state_dict(value):
            found[str(key)] = value
        elif isinstance(value, Mapping):
            for inner, sub in value.items():
                if is_state_dict(sub) and not role_of(str(inner), sub):
                    found[f"{key}.{inner}"] = sub
    return found


def lookup(payload: Mapping, entry: str) -> Any:
    if entry in payload:
        return payload[entry]
    node: Any = payload
    for part in entry.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return None
        node = node[part]
    return node


def split_payload(payload: Any, entry: str | None, entry_flag: str) -> Payload:
    """The state dict (raw names), the ignored training state and the declaration sources."""
    from dflash_audit.formats.safe_pickle import to_plain

    if not isinstance(payload, Mapping):
        raise EntryError(f"holds a {type(payload).__name__}, not a state dict or a training dict")
    if entry is None and is_state_dict(payload):
        return Payload(tensors=only_tensors(payload), entry=None,
                       declarations=extras_as_declarations(payload, "state dict extras"))
    found = candidates(payload)
    if entry is not None:
        chosen = lookup(payload, entry)
        if not is_state_dict(chosen):
            raise EntryError(f"{entry_flag} {entry}: no state dict under that entry (state dicts: "
                             f"{sorted(found) or 'none'}; entries: {sorted(map(str, payload))[:12]})")
    elif len(found) == 1:
        entry, chosen = next(iter(found.items()))
    elif not found:
        raise EntryError(f"no entry holds a state dict (entries: {describe(payload)})")
    else:
        raise EntryError(f"several entries hold state dicts ({', '.join(sorted(found))}); "
                         f"name the drafter's with {entry_flag} KEY")
    top = entry.split(".")[0] if entry not in payload else entry
    ignored, declarations = {}, []
    for key, value in payload.items():
        key = str(key)
        if key == top:
            if isinstance(value, Mapping) and value is not chosen:  # e.g. {"model": {"state_dict", "config"}}
                rest = {k: v for k, v in value.items() if v is not chosen and not isinstance(v, torch.Tensor)}
                if rest:
                    declarations.append((key, to_plain(rest)))
            continue
        role = role_of(key, value)
        if role:
            ignored[key] = role
        elif key in found:
            ignored[key] = "another state dict (not used)"
        elif not isinstance(value, torch.Tensor):
            plain = to_plain(value)
            declarations.append((key, plain) if isinstance(plain, dict) else ("", {key: plain}))
    return Payload(tensors=only_tensors(chosen), entry=entry, ignored=ignored, declarations=declarations)


def only_tensors(state: Mapping) -> dict[str, torch.Tensor]:
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}


def extras_as_declarations(state: Mapping, label: str) -> list[tuple[str, dict[str, Any]]]:
    from dflash_audit.formats.safe_pickle import to_plain

    extras = {k: to_plain(v) for k, v in state.items() if not isinstance(v, torch.Tensor)}
    return [(label, extras)] if extras else []


def describe(payload: Mapping) -> str:
    parts = []
    for key, value in list(payload.items())[:12]:
        kind = type(value).__name__
        parts.append(f"{key} ({kind})")
    return ", ".join(parts) + (" ..." if len(payload) > 12 else "")

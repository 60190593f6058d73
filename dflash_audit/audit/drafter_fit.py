"""Whether a drafter fits a target: its spec (impl/spec.py `spec_misfit`) and, for a reduced draft vocabulary, a usable
draft-to-target map. The one check `eval` (which refuses a drafter that does not fit) and `compare` (which then
leaves its τ unmeasured) share; and the drafter `eval` and `serve-check --live` run, read and checked against the
target's config, then placed beside the target."""

from __future__ import annotations

from pathlib import Path

from dflash_audit.audit.sides import Side, side_of
from dflash_audit.audit.static_vocab import mapping_problem
from foundation.errors import AuditError
from foundation.inputs import check_finite_weights
from foundation.placement import built_in, model_dtype, target_device
from impl.spec import spec_misfit


def misfit(side: Side, hidden_size: int, depth: int, vocab_size: int) -> str | None:
    """Why `side`'s drafter cannot run against a target of this hidden size, decoder depth and vocabulary, or None."""
    why = spec_misfit(side.spec, hidden_size, depth, vocab_size)
    if why is not None:
        return why
    unmapped = mapping_problem(side)
    if unmapped is not None:  # the static draft_vocab finding says what is wrong; no run would be the drafter's
        return (f"its reduced head of {unmapped[0]} tokens has no usable draft-to-target map "
                f"({'; '.join(unmapped[2])})")
    return None


def read_drafter(path: Path, target_dir: Path, config, options=None):
    """The drafter's checked (spec, state dict), against the target's config: no target weights needed."""
    loaded, spec = read_loaded_drafter(path, target_dir, config, options)
    return spec, loaded.state_dict


def read_loaded_drafter(path: Path, target_dir: Path, config, options=None):
    """`read_drafter`'s checks, returning the drafter as loaded (its recipe too) and its spec."""
    from dflash_audit.formats import LoadOptions, load_any, require_spec

    loaded = load_any(path, target_dir, options or LoadOptions(flag_prefix=""))
    spec = require_spec(loaded, "eval")
    check_finite_weights(loaded.state_dict, str(path))  # NaN weights would "measure" τ 1.0, not fail
    why = misfit(side_of(loaded, path), config.hidden_size, config.num_hidden_layers, config.vocab_size)
    if why is not None:
        raise AuditError(f"{path}: the drafter cannot run against {target_dir}: {why}")
    return loaded, spec


def place_drafter(spec, state_dict, path: Path, target):
    """The drafter where the target reads its inputs, in the target's dtype (its serving dtype)."""
    from impl.body_shapes import build_drafter

    return built_in(target_device(target), model_dtype(target),
                    lambda: build_drafter(spec, state_dict, source=str(path))).eval()

"""The drafter `eval` measures: read and checked against the target's config, then placed beside the target."""

from __future__ import annotations

from pathlib import Path

from dflash_audit.audit.drafter_fit import misfit
from dflash_audit.audit.sides import side_of
from foundation.errors import AuditError
from foundation.inputs import check_finite_weights
from foundation.placement import built_in, model_dtype, target_device
from impl.body_shapes import build_drafter


def read_drafter(path: Path, target_dir: Path, config, options=None):
    """The drafter's checked (spec, state dict), against the target's config: no target weights needed."""
    from dflash_audit.formats import LoadOptions, load_any, require_spec

    loaded = load_any(path, target_dir, options or LoadOptions(flag_prefix=""))
    spec = require_spec(loaded, "eval")
    check_finite_weights(loaded.state_dict, str(path))  # NaN weights would "measure" τ 1.0, not fail
    why = misfit(side_of(loaded, path), config.hidden_size, config.num_hidden_layers, config.vocab_size)
    if why is not None:
        raise AuditError(f"{path}: the drafter cannot run against {target_dir}: {why}")
    return spec, loaded.state_dict


def place_drafter(spec, state_dict, path: Path, target):
    """The drafter where the target reads its inputs, in the target's dtype (its serving dtype)."""
    return built_in(target_device(target), model_dtype(target),
                    lambda: build_drafter(spec, state_dict, source=str(path))).eval()

"""The drafter `eval` measures: read and checked against the target's config, then placed beside the target."""

from __future__ import annotations

from pathlib import Path

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
    if spec.hidden_size != config.hidden_size:
        raise AuditError(f"{path}: drafter hidden size {spec.hidden_size}, the target's is {config.hidden_size}")
    depth = config.num_hidden_layers
    if spec.num_target_layers != depth:
        raise AuditError(f"{path}: drafter built for a target of {spec.num_target_layers} layers, "
                         f"{target_dir} has {depth}")
    if spec.target_vocab_size != config.vocab_size:
        raise AuditError(f"{path}: drafter vocabulary {spec.target_vocab_size}, the target's is {config.vocab_size}")
    return spec, loaded.state_dict


def place_drafter(spec, state_dict, path: Path, target):
    """The drafter where the target reads its inputs, in the target's dtype (its serving dtype)."""
    return built_in(target_device(target), model_dtype(target),
                    lambda: build_drafter(spec, state_dict, source=str(path))).eval()

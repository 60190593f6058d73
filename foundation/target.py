"""Loading the target (verifier) model and its tokenizer: the one place every verb does it.

The directory is checked first (`foundation.inputs.check_target_dir`: config fields by name, no
FIFOs, a tokenizer), so a broken target is one line naming its file and field, before any
weights are read.
"""

from __future__ import annotations

from pathlib import Path

from foundation.errors import AuditError, plain_reason
from foundation.inputs import check_target_dir, openable
from foundation.placement import CPU_FLOAT32, Placement
from foundation.transformers_compat import from_pretrained


def quiet_transformers() -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # a bar per load would bury the one-line answers on stderr


def load_tokenizer(target_dir: str | Path, flag: str = "--target"):
    """(tokenizer, config) of a target directory, without its weights."""
    from transformers import AutoConfig, AutoTokenizer

    target_dir = Path(target_dir)
    check_target_dir(target_dir, flag)
    try:
        tokenizer = AutoTokenizer.from_pretrained(openable(target_dir))
    except Exception as exc:  # noqa: BLE001 -- any tokenizer failure is the target's, not the prompt's
        raise AuditError(f"{target_dir}: cannot load the target's tokenizer "
                         f"({plain_reason(str(exc)) or 'no reason given'})") from None
    return tokenizer, AutoConfig.from_pretrained(openable(target_dir))


def load_target_model(target_dir: str | Path, placement: Placement = CPU_FLOAT32):
    """The target model in eval mode, frozen, in the placement's dtype and on its device (or
    sharded by accelerate under `--device-map auto`). Weights go straight to the device: no
    float32 copy on the host first."""
    from transformers import AutoModelForCausalLM

    quiet_transformers()
    kwargs: dict = {"dtype": placement.dtype}
    if placement.attn_implementation is not None:
        kwargs["attn_implementation"] = placement.attn_implementation
    if placement.device_map is not None:
        kwargs["device_map"] = placement.device_map
    elif placement.device.type != "cpu":
        kwargs["device_map"] = {"": str(placement.device)}
    # Before the load: transformers would print its many-line load report of the misfit tensors, then fail.
    mismatch = first_shape_mismatch(Path(target_dir))
    if mismatch is not None:
        raise AuditError(f"{target_dir}: its weights do not fit its config.json ({mismatch})")
    try:
        model = from_pretrained(AutoModelForCausalLM, openable(target_dir), **kwargs)
    except Exception as exc:  # noqa: BLE001 -- transformers' text names no tensor: find the one at fault
        mismatch = first_shape_mismatch(Path(target_dir))
        if mismatch is not None:
            raise AuditError(f"{target_dir}: its weights do not fit its config.json ({mismatch})") from exc
        if not isinstance(exc, (OSError, ValueError, KeyError, TypeError)):
            raise
        raise AuditError(f"{target_dir}: cannot load the target ({plain_reason(str(exc))})") from exc
    return model.eval().requires_grad_(False)


def first_shape_mismatch(target_dir: Path) -> str | None:
    """`tensor NAME is A in the weights, B by config.json` for the first weight whose stored shape is not
    the one the config builds (read from the safetensors headers and a meta-device model); None if all fit."""
    import torch
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        with torch.device("meta"):
            expected = {k: tuple(v.shape) for k, v in AutoModelForCausalLM.from_config(
                AutoConfig.from_pretrained(openable(target_dir))).state_dict().items()}
        for file in sorted(target_dir.glob("*.safetensors")):
            with safe_open(openable(file), framework="pt") as handle:
                for name in handle.keys():
                    stored = tuple(handle.get_slice(name).get_shape())
                    if name in expected and stored != expected[name]:
                        return (f"tensor {name} in {file.name} is {list(stored)}, config.json gives "
                                f"{list(expected[name])}")
    except Exception:  # noqa: BLE001 -- no clearer answer than the loader's own
        return None
    return None


def load_target(target_dir: str | Path, placement: Placement = CPU_FLOAT32):
    """(model, tokenizer) of a checked target directory."""
    quiet_transformers()
    tokenizer, _ = load_tokenizer(target_dir)
    return load_target_model(target_dir, placement), tokenizer

"""Loading the target (verifier) model and its tokenizer: the one place every verb does it.

The directory is checked first (`foundation.inputs.check_target_dir`: config fields by name, no
FIFOs, a tokenizer), so a broken target is one line naming its file and field, before any
weights are read.
"""

from __future__ import annotations

from pathlib import Path

from foundation.errors import AuditError
from foundation.inputs import check_target_dir
from foundation.placement import CPU_FLOAT32, Placement


def quiet_transformers() -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # a bar per load would bury the one-line answers on stderr


def load_tokenizer(target_dir: str | Path, flag: str = "--target"):
    """(tokenizer, config) of a target directory, without its weights."""
    from transformers import AutoConfig, AutoTokenizer

    target_dir = Path(target_dir)
    check_target_dir(target_dir, flag)
    try:
        tokenizer = AutoTokenizer.from_pretrained(target_dir)
    except Exception as exc:  # noqa: BLE001 -- any tokenizer failure is the target's, not the prompt's
        raise AuditError(f"{target_dir}: cannot load the target's tokenizer "
                         f"({type(exc).__name__}: {' '.join(str(exc).split())[:200]})") from None
    return tokenizer, AutoConfig.from_pretrained(target_dir)


def stop_token_ids(tokenizer) -> list[int]:
    """The ids a decoding loop stops at: the tokenizer's eos, when it has one (eval, compare and the suite alike)."""
    return [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []


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
    try:
        model = AutoModelForCausalLM.from_pretrained(Path(target_dir), **kwargs)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise AuditError(f"{target_dir}: cannot load the target ({' '.join(str(exc).split())[:200]})") from exc
    return model.eval().requires_grad_(False)


def load_target(target_dir: str | Path, placement: Placement = CPU_FLOAT32):
    """(model, tokenizer) of a checked target directory."""
    quiet_transformers()
    tokenizer, _ = load_tokenizer(target_dir)
    return load_target_model(target_dir, placement), tokenizer

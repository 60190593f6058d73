"""Input checks done before any work, outside the drafter loaders: each failure is one line
naming the file and the field (or the flag), exit 2.

- a path given as a file must be a regular file: a FIFO or device would block `open` forever;
- text files must be UTF-8;
- a target directory: a config.json transformers accepts (fields checked by name), no
  FIFOs or devices inside, and a tokenizer when one is needed;
- generation flags finite and in range; drafter weights finite.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import torch

from foundation.errors import AuditError, plain_reason
from foundation.jsonl import JsonTooDeep, parse_json

# Target config fields that must be positive integers (transformers' own errors name no file,
# or divide by zero).
POSITIVE_INT_FIELDS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                       "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings")
MAX_TARGET_DIMENSION = 1 << 24  # no model is wider; sizing a tensor by more only fails in the allocator
MAX_TARGET_POSITIONS = 1 << 30
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "spiece.model")


_ALIASES: dict[str, str] = {}


def openable(path: str | Path) -> str:
    """`path` as libraries that take names as UTF-8 (torch, safetensors, tokenizers) can open it: itself, or for
    a name that is not UTF-8 (any bytes are a Linux name) a `/proc/self/fd/N` alias of it, held for the run."""
    name = str(path)
    try:
        name.encode("utf-8")
        return name
    except UnicodeEncodeError:
        pass
    if name not in _ALIASES:
        fd = os.open(name, os.O_PATH)  # no read, no blocking on a FIFO: only a handle on the name
        _ALIASES[name] = f"/proc/self/fd/{fd}"
    return _ALIASES[name]


def regular_file(path: Path, what: str = "file", flag: str | None = None) -> Path:
    """`path` if it is a regular file; opening anything else (a FIFO) could hang."""
    path = Path(path)
    named = f"{flag} {path}" if flag else str(path)
    if not path.exists():
        raise AuditError(f"{named}: no such {what}")
    if not path.is_file():
        raise AuditError(f"{named}: not a regular file (a directory, FIFO or device); expected a {what}")
    return path


def read_utf8(path: Path, what: str = "file") -> str:
    """The text of a regular UTF-8 file; the first bad byte's line is named otherwise."""
    data = regular_file(path, what).read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[:exc.start].count(b"\n") + 1
        raise AuditError(f"{path}:{line}: not UTF-8 text (byte 0x{data[exc.start]:02x})") from None


def read_json_object(path: Path, what: str = "JSON file", error: type[Exception] = AuditError) -> dict:
    """A JSON object from a regular UTF-8 file, or `error` in one line naming the file (and its line): the one
    reader of JSON configs (a target's, a drafter's, a verifier's)."""
    try:
        data = regular_file(path, what).read_bytes()
    except AuditError as exc:
        raise error(str(exc)) from None
    try:
        value = parse_json(data.decode("utf-8"))
    except UnicodeDecodeError as exc:
        line = data[:exc.start].count(b"\n") + 1
        raise error(f"{path}:{line}: not valid JSON: not UTF-8 text (byte 0x{data[exc.start]:02x})") from None
    except json.JSONDecodeError as exc:
        raise error(f"{path}:{exc.lineno}: not valid JSON ({exc.msg})") from None
    except JsonTooDeep as exc:
        raise error(f"{path}: {exc}") from None
    if not isinstance(value, dict):
        raise error(f"{path}: expected a JSON object, found {type(value).__name__}")
    return value


def check_no_special_files(folder: Path, where: str) -> None:
    """A FIFO, socket or device in a model folder (a target's or a drafter's, as its config.json or weights) would
    block a read or be skipped as absent: refused, named. `where`: the folder, in words."""
    for entry in sorted(folder.iterdir()):
        if entry.exists() and not (entry.is_file() or entry.is_dir()):
            raise AuditError(f"{entry}: not a regular file (a FIFO, socket or device) {where}")


def _check_config_fields(config: dict, config_path: Path) -> None:
    from transformers.activations import ACT2FN

    text = config.get("text_config", config)  # multimodal targets nest the language model's config
    for name in POSITIVE_INT_FIELDS:
        value = text.get(name)
        if name in text and value is not None and not (type(value) is int and value > 0):
            raise AuditError(f"{config_path}: field {name!r} must be a positive integer, got {value!r}")
        top = MAX_TARGET_POSITIONS if name == "max_position_embeddings" else MAX_TARGET_DIMENSION
        if type(value) is int and value > top:
            raise AuditError(f"{config_path}: field {name!r} is {value}, past any real model's (at most {top:,})")
    act = text.get("hidden_act")
    if act is not None and (not isinstance(act, str) or act not in ACT2FN):
        raise AuditError(f"{config_path}: field 'hidden_act' is {act!r}, not an activation transformers knows "
                         "(e.g. 'silu', 'gelu')")


def _check_transformers_accepts(directory: Path, config_path: Path) -> None:
    from transformers import AutoConfig

    try:
        AutoConfig.from_pretrained(openable(directory))
    except Exception as exc:  # noqa: BLE001 -- strict-dataclass, KeyError, ValueError...: name the field
        text = plain_reason(str(exc), 400)
        field = re.search(r"field '(\w+)'", text) or re.search(r"`(\w+)`", text)
        where = f"field {field.group(1)!r}: " if field else ""
        raise AuditError(f"{config_path}: {where}not accepted by transformers "
                         f"({text[:200]})") from None


def check_target_dir(directory: Path, flag: str = "--target", tokenizer: bool = True) -> dict:
    """The target's config.json, after every check that needs no model loading."""
    directory = Path(directory)
    if not directory.exists():
        raise AuditError(f"{flag} {directory}: no such directory")
    if not directory.is_dir():
        raise AuditError(f"{flag} {directory}: not a directory; expected a Hugging Face model directory")
    config_path = directory / "config.json"
    if not config_path.exists():
        raise AuditError(f"{flag} {directory}: not a Hugging Face model directory (no config.json)")
    check_no_special_files(directory, "inside the model directory")
    config = read_json_object(config_path, "config.json")
    _check_config_fields(config, config_path)
    _check_transformers_accepts(directory, config_path)
    if tokenizer and not any((directory / name).is_file() for name in TOKENIZER_FILES):
        raise AuditError(f"{flag} {directory}: no tokenizer ({', '.join(TOKENIZER_FILES)}); "
                         "save the target's tokenizer with it")
    return config


def check_finite_weights(state_dict: dict[str, torch.Tensor], source: str) -> None:
    """A drafter with NaN or inf weights drafts garbage that is always rejected: refuse it, naming the tensor."""
    for name, tensor in state_dict.items():
        if not tensor.is_floating_point() and name.endswith((".weight", ".bias")):
            raise AuditError(f"{source}: tensor {name!r} holds {str(tensor.dtype).removeprefix('torch.')} values "
                             "where a drafter has floating-point weights")
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise AuditError(f"{source}: tensor {name!r} has non-finite values (NaN or inf)")

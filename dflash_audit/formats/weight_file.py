"""One weight file read into a `Payload`: a safetensors file (tensors and its metadata), or a torch pickle
read by the restricted unpickler (`safe_pickle`) and split into the drafter's entry (`payload`).

Its own module so that the layouts (`layouts/`) and the foreign loader (`foreign.py`) both read files here
without importing each other.
"""

from __future__ import annotations

import pickle
import re
import zipfile
from pathlib import Path

import torch
from safetensors import safe_open

from dflash_audit.formats.payload import EntryError, Payload, split_payload
from dflash_audit.formats.safe_pickle import UnsafePickle, safe_load
from foundation.errors import CheckpointError
from foundation.inputs import openable


def read_weight_file(path: Path, entry: str | None, entry_flag: str) -> Payload:
    if path.name.endswith(".safetensors"):
        try:
            tensors: dict[str, torch.Tensor] = {}
            with safe_open(openable(path), framework="pt") as handle:
                metadata = handle.metadata() or {}
                for key in handle.keys():
                    tensors[key] = handle.get_tensor(key)
        except Exception as exc:
            raise CheckpointError(f"{path}: unreadable safetensors file ({first_line(exc)})") from exc
        declared = {k: v for k, v in metadata.items() if k != "format"}
        return Payload(tensors=tensors, entry=None, declarations=[("safetensors metadata", declared)] if declared
                       else [])
    try:
        payload = safe_load(path)
    except UnsafePickle as exc:
        raise CheckpointError(f"{path}: {exc}") from exc
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError, OSError, zipfile.BadZipFile,
            AttributeError, ImportError, TypeError, KeyError, IndexError) as exc:
        raise CheckpointError(f"{path}: not a readable torch checkpoint ({first_line(exc)})") from exc
    try:
        return split_payload(payload, entry, entry_flag)
    except EntryError as exc:
        raise CheckpointError(f"{path}: {exc}") from exc


def first_line(exc: BaseException) -> str:
    """The reason a library gave, without torch's weights-only advice, terminal colours or class names."""
    from dflash_audit.faults import clean
    from foundation.pickle_limits import load_failure_reason

    return clean(load_failure_reason(exc)) or "truncated or corrupt"

"""One frame format between a plug and a codebase held in its own process (held/modelopt.py and its worker).

A frame is a length-prefixed `torch.save` of plain values only: tensors, numbers, strings, None, lists, tuples
and dicts; it is read back with `torch.load(weights_only=True)`, so nothing but data crosses. The interface's
own types travel as tagged dicts: a `DraftSpec` by its fields, a target model by its config and weights (sent
once, then by key), a drafter by the key of the one the worker holds, `TrainingOutputs` and `GenerationResult`
by their fields.
"""

from __future__ import annotations

import dataclasses
import io
import struct
from typing import IO, Any

import torch

from impl.interface import GenerationResult, TrainingOutputs
from impl.spec import DraftSpec

TAG = "__wire__"
_LENGTH = struct.Struct("<Q")


def write_frame(stream: IO[bytes], message: Any) -> None:
    buffer = io.BytesIO()
    torch.save(message, buffer)
    payload = buffer.getvalue()
    stream.write(_LENGTH.pack(len(payload)) + payload)
    stream.flush()


def read_frame(stream: IO[bytes]) -> Any:
    header = stream.read(_LENGTH.size)
    if len(header) < _LENGTH.size:
        raise EOFError("the held process closed its pipe")
    (size,) = _LENGTH.unpack(header)
    payload = stream.read(size)
    if len(payload) < size:
        raise EOFError("the held process closed its pipe mid-frame")
    return torch.load(io.BytesIO(payload), weights_only=True)


def tagged(kind: str, **fields: Any) -> dict[str, Any]:
    return {TAG: kind, **fields}


def kind_of(value: Any) -> str | None:
    return value.get(TAG) if isinstance(value, dict) else None


def encode(value: Any, special=None) -> Any:
    """Plain values for a frame; `special(value)` may encode a value of its own (a target, a drafter) first."""
    if special is not None:
        encoded = special(value)
        if encoded is not None:
            return encoded
    if isinstance(value, DraftSpec):
        return tagged("spec", fields=encode(value.to_dict()))
    if isinstance(value, (TrainingOutputs, GenerationResult)):
        kind = "training_outputs" if isinstance(value, TrainingOutputs) else "generation_result"
        return tagged(kind, fields=encode({f.name: getattr(value, f.name) for f in dataclasses.fields(value)}, special))
    if isinstance(value, dict):
        return {key: encode(item, special) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(encode(item, special) for item in value)
    return value


def decode(value: Any, special=None) -> Any:
    """The inverse of `encode`; `special(kind, value)` decodes the tags it knows (None: not one of its own)."""
    kind = kind_of(value)
    if kind is not None and special is not None:
        decoded = special(kind, value)
        if decoded is not None:
            return decoded
    if kind == "spec":
        fields = decode(value["fields"])
        return DraftSpec(**{name: tuple(item) if isinstance(item, list) else item for name, item in fields.items()})
    if kind == "training_outputs":
        return TrainingOutputs(**decode(value["fields"], special))
    if kind == "generation_result":
        return GenerationResult(**decode(value["fields"], special))
    if isinstance(value, dict):
        return {key: decode(item, special) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(decode(item, special) for item in value)
    return value

"""A trace recording's `manifest.json` as one pydantic model, `Manifest`: the recorder's writer builds it through the
model (recording.py `write_recording`) and the reader validates what it reads with the same (`check_manifest`), then
hands the audit the validated model as plain dicts, with the keys the file has, in its order.

Declared: what the writer writes and the audit reads. The manifest is not hashed (the tensor file is): an edited one
is refused by this model, in one line (recording.py `check_manifest`), never a fault further on. Kept as they are (`extra="allow"`): the rest of what the
recorder writes, each tensor entry's role-specific keys (its device, module, call, node, ...) and the run's facts in
`context`, read by the step's and the run's audits."""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError


class _Part(BaseModel):
    # Fields in the order the recorder writes them: the validated manifest, dumped, keeps the file's order.
    model_config = ConfigDict(extra="allow")


class Entry(_Part):
    """One recorded tensor (`step<k>/<name>` in the tensor file)."""
    role: str
    shape: list[int]
    dtype: str


Facts = dict[str, bool | int | list[int] | None]  # a model's declared facts (recorder.py `_config_facts`)


class Drafter(_Part):
    class_: str = Field(alias="class")
    placement: list[str]  # the devices it ran on (the summary names them)
    facts: Facts
    trainable_in_loss: int | None = None  # its trainable parameters the loss reached
    depth_from: str | None = None  # where its depth was read, when its config declares none


class Target(_Part):
    path: str
    class_: str | None = Field(None, alias="class")
    placement: list[str]
    facts: Facts
    dtype: str = "float32"
    layers_placement: list[list[str]] | None = None


class Step(_Part):
    step: int | None = None  # its number in the run, from 1
    loss: float
    entries: dict[str, Entry]
    target_forwards_of_steps: list[int] | None = None  # an offline trainer: the steps whose target forwards it reads
    graph: list[dict[str, Any]] | None = None  # the loss side of its autograd graph
    graph_nodes: int | None = None
    drafter: Drafter
    target: Target
    micro_batches: int | None = None


class Manifest(_Part):
    schema_: str | None = Field(None, alias="schema")
    format: int | None = None
    # A name in the folder, nothing outside it; the writer's is recording.py's TENSORS (this module imports nothing
    # of recording.py, which imports it).
    tensors_file: str = Field("recording.safetensors", pattern=r"^[^/\\]+$")
    tensors_bytes: int | None = None
    tensors_sha256: str | None = None
    tensor_payload_bytes: int | None = None  # the tensors' own bytes (audit_memory.py)
    versions: dict[str, str] | None = None  # torch's and transformers' where it was recorded
    context: dict = {}  # rank, world size, argv, steps asked for, compile_disabled, run (run/recorder.py)
    steps: list[Step] = Field(min_length=1)


class ManifestRefused(ValueError):
    """The recorder's manifest is not one its reader takes (one line)."""


def manifest_problem(exc: ValidationError) -> str:
    """The first thing wrong, as `place: what`."""
    error = exc.errors()[0]
    loc = [str(part) for part in error["loc"]]
    union = [e for e in exc.errors() if [str(part) for part in e["loc"]][:len(loc) - 1] == loc[:-1]]
    if len(union) > 1:  # a union's members each refused it: say the value, not the members' messages
        loc, what = loc[:-1], f"a value of the wrong kind ({error['input']!r:.40})"
    else:
        what = error["msg"].lower()
    return f"{'.'.join(loc) or 'the top level'}: {what}"


def _plain(manifest: Manifest) -> dict:
    return manifest.model_dump(by_alias=True, exclude_unset=True)


def manifest_text(manifest: dict) -> str:
    """What the writer puts in `manifest.json`: `manifest` built through the model; ManifestRefused otherwise."""
    try:
        built = Manifest.model_validate(manifest)
    except ValidationError as exc:
        raise ManifestRefused(f"the recording's manifest: {manifest_problem(exc)} (the recorder cannot write what "
                              "its reader refuses)") from None
    return json.dumps(_plain(built), indent=1, default=str) + "\n"


def validated(manifest: dict) -> dict:
    """The manifest the audit reads: validated whole by the model, as plain dicts (pydantic's ValidationError
    otherwise: recording.py `check_manifest` says it in one line)."""
    return _plain(Manifest.model_validate(manifest))

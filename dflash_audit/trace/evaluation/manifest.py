"""What an evaluation recording's manifest (`evaluation.json`) holds, declared as pydantic models: each recorded call
(the target's, a drafter's, a head's) with the tensors it names, the modules they belong to, the target. A manifest is
validated whole, and the tensors it names held to their roles (token ids and positions integers, margins and
outputs numbers, none empty), before the audit reads a value: a recording that is corrupt, hand-edited or of another
tool is one line naming it, never a fault deep in the audit."""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from foundation.errors import AuditError

TensorKey = Annotated[str, Field(pattern=r"^e\d+\.")]  # a tensor of the recording's tensor file


class _Read(BaseModel):
    # What the recorder writes is read as it is (a string is no number); keys this version does not read are kept.
    model_config = ConfigDict(strict=True, extra="allow")


class TargetCall(_Read):
    kind: Literal["target"]
    module: int = Field(ge=0)
    ids: TensorKey
    positions: TensorKey
    attention_mask: TensorKey | None = None
    logits_from: int = Field(ge=0)
    argmax: TensorKey
    margin: TensorKey
    hidden_states: bool = False


class DrafterCall(_Read):
    kind: Literal["drafter"]
    module: int = Field(ge=0)
    inputs: dict[str, TensorKey]
    output: TensorKey | None = None
    argmax: TensorKey | None = None
    margin: TensorKey | None = None


class HeadCall(_Read):
    kind: Literal["head"]
    module: int
    argmax: TensorKey
    margin: TensorKey


Call = Annotated[Union[TargetCall, DrafterCall, HeadCall], Field(discriminator="kind")]


class RecordedModule(_Read):
    path: str = ""
    facts: dict[str, Any] = {}
    fingerprints: dict[str, list[Any]] = {}


class RecordedTarget(_Read):
    path: str | None = None
    dtype: Literal["float32", "float16", "bfloat16", "float64"] | None = None


class EvaluationManifest(_Read):
    tensors_bytes: int = Field(ge=0)
    tensors_sha256: str
    target: RecordedTarget
    modules: list[RecordedModule] = Field(min_length=1)
    events: list[Call] = Field(min_length=1)
    tau: float | list[float] | None = None
    context: dict[str, Any] = {}

    @model_validator(mode="after")
    def _calls_of_listed_modules(self) -> EvaluationManifest:
        for index, call in enumerate(self.events):
            if call.kind != "head" and call.module >= len(self.modules):
                raise ValueError(f"events.{index}: a call of module {call.module}, which the {len(self.modules)} "
                                 "modules listed do not hold")
        return self


# The tensors each role names: integers (token ids, positions, a mask, a choice) or numbers (margins, features).
INTEGER_ROLES = ("ids", "positions", "attention_mask", "argmax")
NUMBER_ROLES = ("margin", "output")


def check_manifest(manifest: Any, where: str) -> EvaluationManifest:
    """The manifest validated whole; one line naming the first thing wrong otherwise."""
    try:
        return EvaluationManifest.model_validate(manifest)
    except ValidationError as exc:
        error = exc.errors()[0]
        place = ".".join(str(part) for part in error["loc"])
        cause = (error.get("ctx") or {}).get("error")
        words = str(cause) if cause is not None else error["msg"]
        raise AuditError(f"{where}: not an evaluation recording this tool can read "
                         f"({place + ': ' if place else ''}{words}; record it again)") from None


def check_tensors(manifest: EvaluationManifest, tensors: dict[str, torch.Tensor], where: str) -> None:
    """Each named tensor held to its role: integer ids (none negative, none empty), numeric margins and outputs."""
    for call in manifest.events:
        named = {role: getattr(call, role, None) for role in (*INTEGER_ROLES, *NUMBER_ROLES)}
        named.update({f"inputs.{name}": key for name, key in getattr(call, "inputs", {}).items()})
        for role, key in named.items():
            if key is None:
                continue
            if key not in tensors:
                raise AuditError(f"{where}: the manifest names {key!r}, which the tensor file does not hold "
                                 "(record it again)")
            tensor = tensors[key]
            kind = str(tensor.dtype).removeprefix("torch.")
            if role in INTEGER_ROLES and (tensor.is_floating_point() or tensor.is_complex()):
                raise AuditError(f"{where}: {key} ({role}) holds {kind} values; the recorder writes integers there")
            if role in NUMBER_ROLES and not (tensor.is_floating_point() or role == "output"):
                raise AuditError(f"{where}: {key} ({role}) holds {kind} values; the recorder writes numbers there")
            if role in ("ids", "positions", "argmax") and (tensor.dim() == 0 or tensor.numel() == 0):
                raise AuditError(f"{where}: {key} ({role}) is empty (shape {list(tensor.shape)})")
            if role in ("ids", "argmax") and int(tensor.min()) < 0:
                raise AuditError(f"{where}: {key} ({role}) holds a negative token id ({int(tensor.min())})")
            if role in ("ids", "positions") and tensor.dim() != 2:
                raise AuditError(f"{where}: {key} ({role}) has shape {list(tensor.shape)}; the recorder writes "
                                 "[batch, tokens]")


def check_vocabulary(manifest: dict, tensors: dict[str, torch.Tensor], vocab_size: int, where: str) -> None:
    """Every recorded token id (the target's inputs and choices) a row of the target's vocabulary."""
    for call in manifest["events"]:
        for role in ("ids", "argmax"):
            key = call.get(role)
            if key is not None and key in tensors and tensors[key].numel() and int(tensors[key].max()) >= vocab_size:
                raise AuditError(f"{where}: {key} ({role}) holds token id {int(tensors[key].max())}, past the "
                                 f"target's vocabulary of {vocab_size} (not this target's recording)")

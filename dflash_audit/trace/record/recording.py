"""A trace recording on disk: `recording.safetensors` (every tensor, `step<k>/<name>`) and `manifest.json` (format
version, what each tensor is, the step's graph, placement), each written atomically, the manifest last with the
tensor file's size and hash, so a half-written or truncated recording is refused rather than audited.
`trace-error.json` is what the recorder writes instead when the step cannot be audited."""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from foundation.atomic import atomic_write_bytes
from foundation.errors import AuditError

# Set by the verb for the traced command: the recording folder, and the recorder's options (the JSON of
# options.RecorderOptions). Only under `dflash-audit trace` is ENV_OUT set.
ENV_OUT = "DFLASH_AUDIT_TRACE"
ENV_OPTIONS = "DFLASH_AUDIT_TRACE_OPTIONS"
FORMAT = 1
SCHEMA = f"dflash-audit/trace-recording/{FORMAT}"
MANIFEST = "manifest.json"
TENSORS = "recording.safetensors"
ERROR = "trace-error.json"
PARITY = "parity.safetensors"  # trace --parity K: the weights and gradients of the first steps (run/recorder.py)
ERROR_SCHEMA = "dflash-audit/trace-error/1"
# What the tool writes in --out: anything else there is the user's, and the folder is refused.
OWN_FILES = (MANIFEST, TENSORS, ERROR, PARITY, "report.json", "index.html", "evaluation.json", "evaluation.safetensors")


def file_sha256(path: Path) -> str:
    """A file's sha256, read a MiB at a time (a recording's tensors may not fit twice in memory)."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def check_tensors_file(folder: Path, tensors_path: Path, manifest: dict, flag: str) -> None:
    """A recording's tensor file is there, of the size and sha256 its manifest recorded (a truncated or edited file
    is one line, before anything reads it): the trace's and the evaluation recording's one check."""
    if not tensors_path.is_file():
        raise AuditError(f"{flag} {folder}: {tensors_path.name} missing")
    size = tensors_path.stat().st_size
    if size != manifest.get("tensors_bytes") or file_sha256(tensors_path) != manifest.get("tensors_sha256"):
        raise AuditError(f"{flag} {folder}: {tensors_path.name} is truncated or changed ({size} bytes, the "
                         f"manifest recorded {manifest.get('tensors_bytes')})")


@functools.lru_cache(maxsize=1)
def safetensors_dtypes() -> dict:
    """torch dtype -> safetensors' name (made at first use: `trace.step` imports this module, and no torch)."""
    import torch

    return {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
            torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
            torch.bool: "BOOL"}


def write_safetensors(path, tensors: dict, metadata: dict) -> None:
    """The safetensors format written a tensor at a time, from each tensor's own memory: no second copy of the whole
    recording in bytes, which `safetensors.torch.save_file` makes before it writes."""
    import torch

    header: dict = {"__metadata__": metadata}
    offset = 0
    for name, t in tensors.items():
        size = t.numel() * t.element_size()
        header[name] = {"dtype": safetensors_dtypes()[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as handle:
        handle.write(len(text).to_bytes(8, "little"))
        handle.write(text)
        for t in tensors.values():
            if t.numel():
                handle.write(memoryview(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()))


def write_recording(out: Path, steps: list[dict], context: dict) -> None:
    """The steps' tensors, then their manifest built through the model the reader checks (manifest.py);
    manifest.ManifestRefused (one line) when what the recorder gathered is not a manifest that model takes."""
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {f"step{i}/{name}": t for i, record in enumerate(steps) for name, t in record["tensors"].items()}
    if all(t.dtype in safetensors_dtypes() for t in tensors.values()):
        atomic_write_bytes(out / TENSORS, lambda tmp: write_safetensors(tmp, tensors, {"schema": SCHEMA}))
    else:
        atomic_write_bytes(out / TENSORS, lambda tmp: save_file(tensors, tmp, metadata={"schema": SCHEMA}))
    import torch
    import transformers

    from dflash_audit.trace.record.manifest import manifest_text

    text = manifest_text({"schema": SCHEMA, "format": FORMAT, "tensors_file": TENSORS,
                          "tensors_bytes": (out / TENSORS).stat().st_size, "tensors_sha256": file_sha256(out / TENSORS),
                          "tensor_payload_bytes": sum(t.numel() * t.element_size() for t in tensors.values()),
                          "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
                          "context": context, "steps": [record["meta"] for record in steps]})
    atomic_write_bytes(out / MANIFEST, lambda tmp: Path(tmp).write_text(text))


def write_error(out: Path, message: str, step: int, flag: str | None = None) -> None:
    """The recorder's refusal; `flag`: the verb's flag it is about, when it is a flag that does not fit the script."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    text = json.dumps({"schema": ERROR_SCHEMA, "error": message, "step": step, "flag": flag}) + "\n"
    atomic_write_bytes(out / ERROR, lambda tmp: Path(tmp).write_text(text))


@dataclass(frozen=True)
class Refusal:
    message: str
    flag: str | None = None  # about this flag of the verb, not about the script


def read_error(out: Path) -> Refusal | None:
    path = Path(out) / ERROR
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
        flag = data.get("flag")
        return Refusal(str(data["error"]), flag if isinstance(flag, str) else None)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return Refusal(f"{path}: unreadable")


@dataclass
class Recording:
    folder: Path
    manifest: dict
    tensors: dict  # name -> cpu tensor

    @property
    def steps(self) -> list[dict]:
        return self.manifest["steps"]

    def step_tensors(self, index: int) -> dict:
        prefix = f"step{index}/"
        return {name[len(prefix):]: t for name, t in self.tensors.items() if name.startswith(prefix)}


def read_recording(folder: Path, flag: str = "--from") -> Recording:
    """The recording in `folder`, checked whole: its format version, and its tensor file's size and hash."""
    folder = Path(folder)
    manifest_path = folder / MANIFEST
    if not manifest_path.is_file():
        raise AuditError(f"{flag} {folder}: no recording there ({MANIFEST} missing)")
    from foundation.inputs import read_json_object  # not at import: `trace.step` imports this module, and no torch

    manifest = read_json_object(manifest_path, MANIFEST, lambda message: AuditError(f"{flag} {message}"))
    if not str(manifest.get("schema", "")).startswith("dflash-audit/trace-recording"):
        raise AuditError(f"{flag} {folder}: {MANIFEST} is not a dflash-audit trace recording")
    if manifest.get("format") != FORMAT:
        raise AuditError(f"{flag} {folder}: a recording of format {manifest.get('format')!r}; this version of "
                         f"dflash-audit reads format {FORMAT} (record it again)")
    manifest = check_manifest(manifest, f"{flag} {folder}: {MANIFEST}")  # the shared model's, as plain dicts
    tensors_path = folder / str(manifest.get("tensors_file", TENSORS))
    check_tensors_file(folder, tensors_path, manifest, flag)
    from dflash_audit.trace.record.audit_memory import check_fits
    from safetensors.torch import load_file

    recorded_target = (manifest["steps"][0].get("target") or {}).get("path") if manifest["steps"] else None
    check_fits(manifest, folder, Path(recorded_target) if recorded_target else None)  # before anything is loaded
    try:
        tensors = load_file(tensors_path)
    except Exception as exc:  # noqa: BLE001 -- any unreadable file is one line
        raise AuditError(f"{flag} {folder}: {tensors_path.name} is not readable ({exc})") from None
    for index, step in enumerate(manifest["steps"]):
        missing = [name for name in step["entries"] if f"step{index}/{name}" not in tensors]
        if missing:
            raise AuditError(f"{flag} {folder}: {MANIFEST} step {index} names {missing[0]!r}, which "
                             f"{tensors_path.name} does not hold")
        for name, entry in step["entries"].items():
            problem = tensor_problem(tensors[f"step{index}/{name}"], entry)
            if problem:
                raise AuditError(f"{flag} {folder}: step {index}'s {name!r} {problem} (not the recording the "
                                 "recorder wrote; record it again)")
    named = {f"step{index}/{name}" for index, step in enumerate(manifest["steps"]) for name in step["entries"]}
    unnamed = sorted(set(tensors) - named)
    if unnamed:  # every tensor read is accounted for: one the manifest does not describe cannot be
        raise AuditError(f"{flag} {folder}: {tensors_path.name} holds {unnamed[0]!r}, which {MANIFEST} does not name "
                         "(not the recording the recorder wrote; record it again)")
    return Recording(folder, manifest, tensors)


# What the audit reads of each role: token ids index the target's embedding; the drafter's inputs, its logits and
# the loss's draft side are compared by value with the target's tensors, row by row.
# The recorder runs the script's torch.compile'd code eagerly (hooks.py, `_install_compile_stance`): said in the report.
COMPILE_DISABLED = ("torch.compile was disabled while recording: the step ran eagerly, the same operations (in eager "
                    "kernels, so a value may differ from the compiled run's by rounding)")


def compile_notes(manifest: dict) -> list[str]:
    """The note for a recording of a script that compiled code (none for one that did not)."""
    return [COMPILE_DISABLED] if manifest.get("context", {}).get("compile_disabled") else []


ID_ROLES = ("tokens", "embedding_ids")
VALUE_ROLES = ("drafter_input", "draft_logits", "loss_draft_side", "loss_gradient")


def tensor_problem(tensor, entry: dict) -> str | None:
    """Why a recorded tensor is not what its manifest entry and role say (None: it is)."""
    kind = str(tensor.dtype).replace("torch.", "")
    if list(tensor.shape) != list(entry["shape"]) or kind != entry["dtype"]:
        return (f"is {list(tensor.shape)} {kind} in the tensor file, but the manifest recorded {entry['shape']} "
                f"{entry['dtype']}")
    role = entry["role"]
    if role in ID_ROLES + VALUE_ROLES and (tensor.dim() == 0 or tensor.numel() == 0):
        return f"({role}) is {'a scalar' if tensor.dim() == 0 else 'empty'}"
    if role in ID_ROLES and (tensor.is_floating_point() or tensor.is_complex() or kind == "bool"):
        return f"({role}) holds {kind} values, not token ids"
    if role in VALUE_ROLES and not tensor.is_floating_point():
        return f"({role}) holds {kind} values, not activations"
    return None


def check_manifest(manifest: dict, where: str) -> dict:
    """The manifest holds what the audit reads, of the kinds it reads (manifest.py's model, the writer's): the audit
    gets it as plain dicts. The tensor file is hashed, the manifest is not: an edited one is refused here in one
    line, never a fault further on."""
    from pydantic import ValidationError

    from dflash_audit.trace.record.manifest import manifest_problem, validated

    try:
        return validated(manifest)
    except ValidationError as exc:
        raise AuditError(f"{where}: {manifest_problem(exc)} (not what a recording of format {FORMAT} holds; record "
                         "it again)") from None


def foreign_entries(out: Path) -> list[str]:
    """Entries of `out` the tool did not write (a recording, an error, a report of its own)."""
    from dflash_audit.outputs import written_by_us

    out = Path(out)
    if not out.is_dir():
        return []
    foreign = []
    for entry in sorted(out.iterdir()):
        if entry.name not in OWN_FILES or not entry.is_file():
            foreign.append(entry.name)
        elif entry.name in (TENSORS, PARITY, "evaluation.safetensors"):
            if not str(_schema_of_safetensors(entry)).startswith("dflash-audit/trace-"):
                foreign.append(entry.name)
        elif not written_by_us(entry):
            foreign.append(entry.name)
    return foreign


def _schema_of_safetensors(path: Path) -> str | None:
    try:
        with open(path, "rb") as handle:
            length = int.from_bytes(handle.read(8), "little")
            if length <= 0 or length > 100 << 20:
                return None
            header = json.loads(handle.read(length))
        return header.get("__metadata__", {}).get("schema")
    except (OSError, ValueError):
        return None

"""What the audit of a recording will hold at its peak, estimated from the manifest before anything is loaded, and a
refusal where it would not fit: an out-of-memory kill after the user's step has run is the worst outcome the tool
can have, so the recording is kept and the line says how to audit it elsewhere.

The estimate adds what the audit holds at once: the recorded tensors (read whole), the target's weights, one
replay's working set (one layer's states in float32 several times over; the replay's own forward: its widest
activations and, under eager attention, one layer's attention scores), a few vocabulary-wide tables in float32
(the draft rows and the targets read from the loss's gradient), and the chunked work, plus the interpreter and
torch. It errs high: a false refusal costs a rerun elsewhere, a false pass costs the report.
"""

from __future__ import annotations

import math
from pathlib import Path

from foundation.errors import AuditError

BASELINE = 1 << 30  # the interpreter, torch, transformers, the tool itself


def available_bytes() -> int | None:
    """The memory the kernel says a new allocation can take (MemAvailable), or None where it does not say."""
    try:
        with open("/proc/meminfo") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def folder_weight_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in Path(folder).glob("*.safetensors")) or \
        sum(p.stat().st_size for p in Path(folder).glob("*.bin"))


def estimate_bytes(manifest: dict, target_dir: Path | None) -> int:
    """The audit's peak, from the manifest's shapes and the target's files."""
    steps = manifest.get("steps") or []
    if not steps:
        return BASELINE
    payload = int(manifest.get("tensor_payload_bytes") or 0)
    facts = steps[0].get("target", {}).get("facts", {})
    hidden = int(facts.get("hidden_size") or 0)
    vocab = int(facts.get("vocab_size") or 0)
    heads = int(facts.get("num_attention_heads") or 16)
    weights = folder_weight_bytes(target_dir) if target_dir is not None and Path(target_dir).is_dir() else 0
    widest = 0  # the largest vocabulary-wide recorded tensor, in float32
    positions = 0
    longest = 0
    for step in steps:
        tokens = [e["shape"] for e in step.get("entries", {}).values() if e.get("role") == "tokens"]
        positions = max(positions, sum(math.prod(s) for s in tokens))
        longest = max([longest] + [s[-1] for s in tokens if s])
        for entry in step.get("entries", {}).values():
            shape = entry.get("shape") or []
            if vocab and shape and shape[-1] == vocab:
                widest = max(widest, math.prod(shape) * 4)
    batch = max(1, positions // max(longest, 1))
    replay = 8 * positions * hidden * 4 + 4 * positions * 4 * hidden * 4 + batch * heads * longest * longest * 4
    from dflash_audit.target_values import CHUNK_ROWS  # the by-value core's rows a chunk

    chunks = 8 * CHUNK_ROWS * vocab * 4
    return BASELINE + payload + weights + 4 * widest + replay + chunks


def check_fits(manifest: dict, folder: Path, target_dir: Path | None) -> None:
    """Refuse (exit 2, the recording kept) an audit whose estimated peak exceeds the memory available now."""
    free = available_bytes()
    if free is None:
        return
    need = estimate_bytes(manifest, target_dir)
    if need > free:
        raise AuditError(f"the audit of the recording in {folder} needs about {need / 2**30:.1f} GiB and "
                         f"{free / 2**30:.1f} GiB is available: the recording is kept; audit it where more memory is "
                         f"free with `dflash-audit trace --from {folder}` (its size is the traced batch's: record fewer "
                         "rows a step to bound it)")

"""GGUF files written by llama.cpp's own tools: `convert_hf_to_gguf.py` from the pinned tree (through
llamacpp_converter_shim.py, which settles only a plain byte-level pre-tokenizer's unknown hash) and `llama-quantize`.

- A drafter: `convert_hf_to_gguf.py ZLAB_DIR --target-model-dir TARGET --outtype f32|f16|bf16|q8_0`; q4_k_m is
  `llama-quantize` of the f32 file (the converter has no k-quants). A tensor whose rows the k-quant blocks cannot
  tile is given another type by llama-quantize itself: the file's own per-tensor types are what the audit reads.
- The target: converted once at f32 and kept in the engine's cache, keyed by the target folder's content; the
  few most recently used are kept.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from foundation.cache_dir import build_once
from foundation.errors import AuditError
from serving_engines.live.llamacpp_env import LlamacppEngine, engine_dir, source_tree

SHIM = Path(__file__).with_name("llamacpp_converter_shim.py")
CONVERTER_TYPES = ("f32", "f16", "bf16", "q8_0")
QUANTIZER_TYPES = {"q4_k_m": "Q4_K_M"}
QUANT_TYPES = CONVERTER_TYPES + tuple(QUANTIZER_TYPES)
SETTLED_MARK = "llamacpp-converter-shim: unknown pre-tokenizer hash settled"
CONVERT_TIMEOUT_S = 1800


def run_converter(model_dir: Path, out_file: Path, outtype: str, target_dir: Path | None = None,
                  cache: str | Path | None = None) -> list[str]:
    """The tree's converter writes `out_file` (through a temporary name, renamed when whole); the notes it earns
    (a settled pre-tokenizer) are returned. Its last message is the error when it fails."""
    tree = source_tree(cache)
    if not (tree / "convert_hf_to_gguf.py").is_file():
        raise AuditError(f"llama.cpp converter: {tree / 'convert_hf_to_gguf.py'} does not exist; build the pinned "
                         "engine with `make setup`")
    out_file.parent.mkdir(parents=True, exist_ok=True)
    partial = out_file.with_name(f".{out_file.name}.partial")
    command = [sys.executable, str(SHIM), str(tree), str(model_dir), "--outfile", str(partial), "--outtype", outtype]
    if target_dir is not None:
        command += ["--target-model-dir", str(target_dir)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree / "gguf-py"), str(tree)])}
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=CONVERT_TIMEOUT_S, env=env)
    except subprocess.TimeoutExpired:
        partial.unlink(missing_ok=True)
        raise AuditError(f"{model_dir}: llama.cpp's converter ran past {CONVERT_TIMEOUT_S} s") from None
    if done.returncode != 0:
        partial.unlink(missing_ok=True)
        last = [line for line in done.stderr.strip().splitlines() if line.strip()] or ["no output"]
        raise AuditError(f"{model_dir}: llama.cpp's convert_hf_to_gguf.py failed: {last[-1].strip()}")
    os.replace(partial, out_file)
    return ["llama.cpp's converter did not know the target tokenizer's pre-tokenizer hash; its pre-tokenizer is "
            "plain byte-level, so it was written as 'gpt-2' (the converter's wrapper, the tree unedited)"] \
        if SETTLED_MARK in done.stderr else []


def quantize(engine: LlamacppEngine, source: Path, out_file: Path, quant: str) -> None:
    partial = out_file.with_name(f".{out_file.name}.partial")
    try:
        done = subprocess.run([engine.quantize, str(source), str(partial), QUANTIZER_TYPES[quant], "1"],
                              capture_output=True, text=True, timeout=CONVERT_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        partial.unlink(missing_ok=True)
        raise AuditError(f"{source}: llama-quantize ran past {CONVERT_TIMEOUT_S} s") from None
    if done.returncode != 0:
        partial.unlink(missing_ok=True)
        last = [line for line in (done.stderr + done.stdout).strip().splitlines() if line.strip()] or ["no output"]
        raise AuditError(f"{source}: llama-quantize {QUANTIZER_TYPES[quant]} failed: {last[-1].strip()}")
    os.replace(partial, out_file)


def drafter_gguf(zlab_dir: Path, target_dir: Path, out_file: Path, quant: str, engine: LlamacppEngine | None,
                 cache: str | Path | None = None) -> list[str]:
    """A z-lab drafter folder as a GGUF of type `quant` (one of `QUANT_TYPES`, as the `--quant` flags declare it), by
    llama.cpp's converter (and quantizer)."""
    if quant in CONVERTER_TYPES:
        return run_converter(zlab_dir, out_file, quant, target_dir, cache)
    if engine is None:
        raise AuditError(f"--quant {quant}: needs llama-quantize (build the engine with `make setup`)")
    with tempfile.TemporaryDirectory(dir=out_file.parent, prefix=".f32-") as scratch:
        f32 = Path(scratch) / "drafter-f32.gguf"
        notes = run_converter(zlab_dir, f32, "f32", target_dir, cache)
        quantize(engine, f32, out_file, quant)
    return notes + [f"quantized by llama-quantize {QUANTIZER_TYPES[quant]} from the converter's f32 file"]


# The target cache's key is the folder's content, not its path: a target copied to a temporary folder per run finds
# its one entry. A file up to WHOLE_FILE_BYTES is hashed whole; a larger one (a weights shard) by its size and
# SAMPLES evenly spaced reads of SAMPLE_BYTES, the first holding its header (the safetensors tensor table): at most
# 16 MiB read per file, about 0.1 s for a 16 GB target, where hashing it whole would read all 16 GB. Trained weights
# that differ differ nearly everywhere, so the samples see them.
WHOLE_FILE_BYTES = 64 << 20
SAMPLES, SAMPLE_BYTES = 256, 64 << 10
KEPT_TARGETS = 4  # the target GGUFs kept, the most recently used; older ones are removed when another is used
TARGET_FILE = "target-f32.gguf"


def _file_digest(path: Path, digest) -> None:
    size = path.stat().st_size
    digest.update(f"{path.name}:{size}:".encode())
    with open(path, "rb") as handle:
        if size <= WHOLE_FILE_BYTES:
            for chunk in iter(lambda: handle.read(1 << 20), b""):
                digest.update(chunk)
            return
        for index in range(SAMPLES):
            handle.seek(index * (size - SAMPLE_BYTES) // (SAMPLES - 1))
            digest.update(handle.read(SAMPLE_BYTES))


def target_key(target_dir: Path) -> str:
    """The target folder's files by content (names, sizes, bytes; large files sampled): the same target in
    another folder shares the entry, a changed one is converted again."""
    digest = hashlib.sha256(b"target-files/2\n")
    for path in sorted(p for p in target_dir.iterdir() if p.is_file()):
        _file_digest(path, digest)
    return digest.hexdigest()[:16]


def prune_targets(targets: Path, in_use: Path, keep: int = KEPT_TARGETS) -> list[Path]:
    """Remove the least recently used target entries beyond `keep` (`in_use` is always kept): only folders holding
    nothing but what `target_gguf` writes, and only when no other process holds their lock. Returns those removed."""
    from filelock import FileLock, Timeout

    ours = {TARGET_FILE, Path(TARGET_FILE).with_suffix(".lock").name}

    def last_used(entry: Path) -> float:
        gguf = entry / TARGET_FILE
        return gguf.stat().st_mtime if gguf.is_file() else entry.stat().st_mtime

    entries = [e for e in targets.iterdir() if e.is_dir() and not e.is_symlink() and e != in_use
               and {p.name for p in e.iterdir()} <= ours and (e / TARGET_FILE).is_file()]
    removed = []
    for entry in sorted(entries, key=last_used, reverse=True)[max(keep - 1, 0):]:
        lock = entry / Path(TARGET_FILE).with_suffix(".lock").name
        try:
            with FileLock(str(lock), timeout=0):
                (entry / TARGET_FILE).unlink(missing_ok=True)
        except Timeout:
            continue  # another process is converting or reading it: leave it
        lock.unlink(missing_ok=True)
        entry.rmdir()
        removed.append(entry)
    return removed


def target_gguf_path(target_dir: Path, cache: str | Path | None = None) -> Path:
    """Where the target's f32 GGUF is kept (a GGUF the user gave is itself)."""
    if target_dir.is_file():
        return target_dir
    return engine_dir(cache) / "targets" / target_key(target_dir) / TARGET_FILE


def target_gguf(target_dir: Path, cache: str | Path | None = None) -> tuple[Path, list[str]]:
    """The target as an f32 GGUF, converted once and kept in the engine's cache."""
    out = target_gguf_path(target_dir, cache)
    if out == target_dir:
        return out, []
    notes: list[str] = []

    def convert() -> Path:
        notes.extend(run_converter(target_dir, out, "f32", None, cache))
        return out

    path = build_once(out.with_suffix(".lock"), lambda: out if out.is_file() else None, convert)
    os.utime(path)  # its last use: what prune_targets keeps by
    prune_targets(path.parent.parent, path.parent)
    return path, notes

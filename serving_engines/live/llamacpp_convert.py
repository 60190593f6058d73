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
import json
import os
import shutil
import subprocess
import sys
import tempfile
from functools import lru_cache
from pathlib import Path

from foundation.atomic import atomic_write_text
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
    llama.cpp's converter (and quantizer). Converted once per content and kept in the engine's cache
    (`drafter_key`); `out_file` is a copy, written through a temporary name."""
    kept, notes = kept_drafter_gguf(zlab_dir, target_dir, quant, engine, cache)
    partial = out_file.with_name(f".{out_file.name}.partial")
    try:
        shutil.copyfile(kept, partial)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    os.replace(partial, out_file)
    return notes


def kept_drafter_gguf(zlab_dir: Path, target_dir: Path, quant: str, engine: LlamacppEngine | None,
                      cache: str | Path | None = None) -> tuple[Path, list[str]]:
    """The engine cache's GGUF of the drafter folder at type `quant` (converted now if no run has yet), to be read
    where it is (the newest entry: no other run prunes it), and the notes its conversion earned."""
    if quant not in CONVERTER_TYPES and engine is None:
        raise AuditError(f"--quant {quant}: needs llama-quantize (build the engine with `make setup`)")
    entry = engine_dir(cache) / "drafters" / drafter_key(zlab_dir, target_dir, quant, engine, cache)
    kept, kept_notes = entry / DRAFTER_FILE, entry / DRAFTER_NOTES

    def convert() -> Path:
        entry.mkdir(parents=True, exist_ok=True)
        notes = _convert_drafter(zlab_dir, target_dir, kept, quant, engine, cache)
        atomic_write_text(kept_notes, json.dumps(notes))  # the notes last: an entry without them is not whole
        return kept

    build_once(kept.with_suffix(".lock"), lambda: kept if kept.is_file() and kept_notes.is_file() else None,
               convert)
    os.utime(kept)  # its last use, what prune_kept keeps by: the newest entry is never the one another run prunes
    notes = json.loads(kept_notes.read_text())
    prune_kept(entry.parent, entry, (DRAFTER_FILE, DRAFTER_NOTES), KEPT_DRAFTERS, KEPT_DRAFTER_BYTES)
    return kept, notes


def _convert_drafter(zlab_dir: Path, target_dir: Path, out_file: Path, quant: str, engine: LlamacppEngine | None,
                     cache: str | Path | None) -> list[str]:
    if quant in CONVERTER_TYPES:
        return run_converter(zlab_dir, out_file, quant, target_dir, cache)
    with tempfile.TemporaryDirectory(dir=out_file.parent, prefix=".f32-") as scratch:
        f32 = Path(scratch) / "drafter-f32.gguf"
        notes = run_converter(zlab_dir, f32, "f32", target_dir, cache)
        quantize(engine, f32, out_file, quant)
    return notes + [f"quantized by llama-quantize {QUANTIZER_TYPES[quant]} from the converter's f32 file"]


# A drafter's GGUF is kept under everything it is made from: the drafter folder's bytes, every file whole (a drafter
# retrained on a few rows differs in a few rows), the target's content as its own cache keys it (the converter takes
# the tokenizer, embeddings and head from it), the type, the converter (the tree's Python, this module and the
# shim, and the versions of the libraries it runs on) and, for a k-quant, the quantizer binary.
DRAFTER_FILE, DRAFTER_NOTES = "drafter.gguf", "notes.json"
# The most recently used are kept: up to 32 of them (a suite's or a sweep's distinct drafters, each read again without
# a new conversion), within 16 GiB of GGUFs (four f32 drafters of a 8B target's size; the newest is always kept).
KEPT_DRAFTERS = 32
KEPT_DRAFTER_BYTES = 16 << 30
CONVERTER_LIBRARIES = ("torch", "numpy", "safetensors", "transformers", "sentencepiece")


def drafter_key(zlab_dir: Path, target_dir: Path | None, quant: str, engine: LlamacppEngine | None,
                cache: str | Path | None = None) -> str:
    digest = hashlib.sha256(b"drafter-gguf/1\n")
    for path in sorted(p for p in Path(zlab_dir).rglob("*") if p.is_file()):
        digest.update(f"{path.relative_to(zlab_dir).as_posix()}:{path.stat().st_size}:".encode())
        with open(path, "rb") as handle:
            for chunk in iter(lambda: handle.read(1 << 20), b""):
                digest.update(chunk)
    digest.update(f"target:{target_key(target_dir) if target_dir is not None else None}\nquant:{quant}\n"
                  f"converter:{_converter_identity(str(source_tree(cache)))}\n".encode())
    if quant not in CONVERTER_TYPES and engine is not None:
        binary = Path(engine.quantize).stat()
        digest.update(f"quantizer:{engine.quantize}:{binary.st_size}:{binary.st_mtime_ns}\n".encode())
    return digest.hexdigest()[:24]


@lru_cache(maxsize=4)
def _converter_identity(tree: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    digest = hashlib.sha256()
    root = Path(tree)
    for path in sorted([root / "convert_hf_to_gguf.py", *root.glob("conversion/**/*.py"),
                        *root.glob("gguf-py/**/*.py"), SHIM, Path(__file__)]):
        if path.is_file():
            digest.update(f"{path.name}:".encode() + path.read_bytes())
    for name in CONVERTER_LIBRARIES:
        try:
            digest.update(f"{name}=={version(name)}\n".encode())
        except PackageNotFoundError:
            digest.update(f"{name} absent\n".encode())
    return digest.hexdigest()


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
    return prune_kept(targets, in_use, (TARGET_FILE,), keep)


def prune_kept(folder: Path, in_use: Path, files: tuple[str, ...], keep: int,
               max_bytes: int | None = None) -> list[Path]:
    """Remove the least recently used entries of `folder` beyond `keep`, or beyond `max_bytes` of their files with
    `in_use`'s (`in_use` is always kept): only entries holding nothing but `files` (the first, the GGUF, there), never
    one whose lock another process holds."""
    from filelock import FileLock, Timeout

    gguf_name = files[0]
    lock_name = Path(gguf_name).with_suffix(".lock").name
    ours = {*files, lock_name}

    def last_used(entry: Path) -> float:
        gguf = entry / gguf_name
        return gguf.stat().st_mtime if gguf.is_file() else entry.stat().st_mtime

    entries = [e for e in folder.iterdir() if e.is_dir() and not e.is_symlink() and e != in_use
               and {p.name for p in e.iterdir()} <= ours and (e / gguf_name).is_file()]
    def size(entry: Path) -> int:
        return sum((entry / name).stat().st_size for name in files if (entry / name).is_file())

    newest_first = sorted(entries, key=last_used, reverse=True)
    kept_count, total = max(keep - 1, 0), size(in_use) if in_use.is_dir() else 0
    if max_bytes is not None:
        for count, entry in enumerate(newest_first[:kept_count]):
            total += size(entry)
            if total > max_bytes:
                kept_count = count
                break
    removed = []
    for entry in newest_first[kept_count:]:
        lock = entry / lock_name
        try:
            with FileLock(str(lock), timeout=0):
                for name in files:
                    (entry / name).unlink(missing_ok=True)
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

"""The rows of a benchmark's local file: JSON lines, one JSON list, or parquet (through `datasets`)."""

from __future__ import annotations

import json
from pathlib import Path

from foundation.errors import AuditError
from foundation.inputs import read_utf8, regular_file
from foundation.jsonl import json_lines

PARQUET_SUFFIXES = (".parquet", ".pq")


def _parquet_rows(path: Path) -> list[dict]:
    """Parquet through `datasets`' local parquet loader, as the references load these sets; its Arrow cache
    goes to a folder dropped afterwards (nothing left in the user's Hugging Face cache), its logging muted
    (a bad file is this tool's one line)."""
    import tempfile

    import datasets
    from datasets import load_dataset

    with path.open("rb") as handle:  # a parquet file starts and ends with its magic bytes
        head = handle.read(4)
        handle.seek(max(0, path.stat().st_size - 4))
        tail = handle.read(4)
    if head != b"PAR1" or tail != b"PAR1":
        raise AuditError(f"{path}: not a readable parquet file (no PAR1 magic bytes at its start and end)")
    datasets.utils.logging.set_verbosity(datasets.utils.logging.CRITICAL)
    datasets.disable_progress_bars()
    try:
        with tempfile.TemporaryDirectory(prefix="dflash-audit-parquet-") as cache:
            return [dict(row) for row in load_dataset("parquet", data_files=str(path), split="train",
                                                      cache_dir=cache)]
    except Exception as exc:  # noqa: BLE001 -- any reader failure is this file's problem, said in one line
        reason = " ".join(str(exc).split())[:160] or type(exc).__name__
        raise AuditError(f"{path}: not a readable parquet file ({reason})") from exc


def _json_rows(path: Path) -> list:
    text = read_utf8(path, "prompts file")
    stripped = text.lstrip()
    if stripped.startswith("["):  # one JSON list of rows (FastChat's and some exports)
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as exc:
            raise AuditError(f"{path}: invalid JSON ({exc.msg})") from exc
        return rows
    return [record for _, _, record in json_lines(text, path, AuditError)]


def read_rows(path: str | Path) -> list[dict]:
    """Every row of `path` as a dict; a row that is not a JSON object is a one-line error naming it."""
    path = regular_file(Path(path), "prompts file", "--prompts")
    rows = _parquet_rows(path) if path.suffix.lower() in PARQUET_SUFFIXES else _json_rows(path)
    for number, row in enumerate(rows, start=1):
        if not isinstance(row, dict):
            raise AuditError(f"{path}: row {number} is a {type(row).__name__}, expected an object")
    if not rows:
        raise AuditError(f"{path}: no rows in the file")
    return rows

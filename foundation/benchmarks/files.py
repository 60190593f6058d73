"""The rows of a benchmark's local file: JSON lines, one JSON list, or parquet (pyarrow, bounded)."""

from __future__ import annotations

import json
from pathlib import Path

from foundation.errors import AuditError, plain_reason
from foundation.inputs import read_utf8, regular_file
from foundation.jsonl import JsonTooDeep, json_lines, parse_json

PARQUET_SUFFIXES = (".parquet", ".pq")


MAX_PARQUET_FOOTER = 16 << 20  # a prompt set's metadata is kilobytes
MAX_PARQUET_ROWS = 1 << 20
MAX_PARQUET_BYTES = 512 << 20  # decoded: a prompt set is megabytes; a decompression bomb is stopped here


def _parquet_rows(path: Path) -> list[dict]:
    """Parquet rows as plain values (what `datasets`' parquet loader gives for text sets), read through pyarrow one
    row at a time and counted as decoded: a file whose pages decompress, or whose dictionary repeats, past
    MAX_PARQUET_BYTES is refused before it is held (a decompression bomb), and nothing is cached on disk."""
    import pyarrow.parquet as pq

    size = path.stat().st_size
    with path.open("rb") as handle:  # a parquet file starts with its magic bytes, ends with footer length and magic
        head = handle.read(4)
        handle.seek(max(0, size - 8))
        tail = handle.read(8)
    if head != b"PAR1" or tail[4:] != b"PAR1":
        raise AuditError(f"{path}: not a readable parquet file (no PAR1 magic bytes at its start and end)")
    if int.from_bytes(tail[:4], "little") > MAX_PARQUET_FOOTER:
        raise AuditError(f"{path}: its parquet metadata claims {int.from_bytes(tail[:4], 'little'):,} bytes, more "
                         f"than {MAX_PARQUET_FOOTER >> 20} MiB; refusing it")
    try:
        parquet = pq.ParquetFile(path)
        if parquet.metadata.num_rows > MAX_PARQUET_ROWS:
            raise AuditError(f"{path}: {parquet.metadata.num_rows:,} rows, more than a prompt set's "
                             f"{MAX_PARQUET_ROWS:,}; refusing it")
        rows, decoded = [], 0
        for batch in parquet.iter_batches(batch_size=1):
            decoded += batch.nbytes
            if decoded > MAX_PARQUET_BYTES:
                raise AuditError(f"{path}: decodes past {MAX_PARQUET_BYTES >> 20} MiB by row {len(rows) + 1} (a "
                                 "decompression bomb, or not a prompt set); refusing it")
            rows += batch.to_pylist()
        return rows
    except AuditError:
        raise
    except Exception as exc:  # noqa: BLE001 -- any reader failure is this file's problem, said in one line
        raise AuditError(f"{path}: not a readable parquet file ({plain_reason(str(exc), 160) or 'corrupt'})") from exc


def _json_rows(path: Path) -> list:
    text = read_utf8(path, "prompts file")
    stripped = text.lstrip()
    if stripped.startswith("["):  # one JSON list of rows (FastChat's and some exports)
        try:
            rows = parse_json(text)
        except json.JSONDecodeError as exc:
            raise AuditError(f"{path}: invalid JSON ({exc.msg})") from exc
        except JsonTooDeep as exc:
            raise AuditError(f"{path}: {exc}") from None
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

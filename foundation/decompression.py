"""How far a compressed input may expand: the one bound every reader of a compressed file holds it to (a gzipped
SpecForge record, a gzipped `.nemo` archive's members, a torch checkpoint whose zip entries are compressed).

Hidden states and weights are floating-point data, which compresses little (well under 2x); a file that expands
past `MAX_RATIO` times its size on disk, beyond `FLOOR` bytes, is a decompression bomb (a few megabytes of zeros
that become gigabytes) and is refused, naming the file and both sizes, before more than the bound is held or
written. Under `FLOOR` every file is read whatever its ratio (a small all-zero record is data to judge, not a bomb).
"""

from __future__ import annotations

from pathlib import Path
from typing import BinaryIO

MAX_RATIO = 100
FLOOR = 64 << 20
CHUNK = 16 << 20
MAX_EXPANDED_BYTES = 256 << 30  # far past any drafter or checkpoint: the ceiling on a file no other bound holds


class DecompressionBomb(ValueError):
    """A compressed input past its bound; the message gives the sizes (the caller names the file)."""


def bound(compressed_bytes: int, ceiling: int) -> int:
    """The most a file of `compressed_bytes` on disk may expand to (never past `ceiling`)."""
    return min(ceiling, max(FLOOR, MAX_RATIO * compressed_bytes))


def refusal(compressed_bytes: int, limit: int, expanded: str | None = None) -> DecompressionBomb:
    expands = expanded or f"past {limit:,} bytes"
    rule = (f"{MAX_RATIO}x its size, or {FLOOR >> 20} MiB, whichever is more"
            if limit == max(FLOOR, MAX_RATIO * compressed_bytes) else "the most any such file holds")
    return DecompressionBomb(f"refused as a decompression bomb: its {compressed_bytes:,} bytes on disk expand "
                             f"{expands} (at most {limit:,}: {rule})")


def read_bounded(stream: BinaryIO, compressed_bytes: int, ceiling: int) -> bytes:
    """All of `stream` (a decompressing reader), refused as a bomb once it passes `bound(...)`: read a chunk at a
    time, so no more than the bound is ever held; running out of memory before it is the same refusal."""
    limit = bound(compressed_bytes, ceiling)
    chunks: list[bytes] = []
    held = 0
    try:
        while chunk := stream.read(min(CHUNK, limit + 1 - held)):
            held += len(chunk)
            if held > limit:
                raise refusal(compressed_bytes, limit)
            chunks.append(chunk)
        return b"".join(chunks)
    except MemoryError:
        chunks.clear()
        raise refusal(compressed_bytes, limit, f"past the memory free after {held:,} bytes") from None


def check_stated(compressed_path: Path, stated_bytes: int, ceiling: int) -> None:
    """A member whose stated size (a tar header's) is past the bound of the compressed file holding it."""
    compressed = compressed_path.stat().st_size
    limit = bound(compressed, ceiling)
    if stated_bytes > limit:
        raise refusal(compressed, limit, f"to {stated_bytes:,} bytes")


def check_zip(path: str | Path, ceiling: int) -> None:
    """A zip archive (torch's checkpoint format) whose entries, by its own directory, expand past the bound of its
    size on disk: torch's reader inflates a compressed entry whole into memory, so it is refused before. Entries
    torch writes are stored (their sizes sum to under the file's): only compressed ones can pass the bound."""
    import zipfile

    try:
        with zipfile.ZipFile(path) as archive:
            expanded = sum(entry.file_size for entry in archive.infolist())
    except (zipfile.BadZipFile, OSError, ValueError, EOFError):
        return  # a corrupt archive: torch's reader names what is wrong with it
    compressed = Path(path).stat().st_size
    limit = bound(compressed, ceiling)
    if expanded > limit:
        raise refusal(compressed, limit, f"to {expanded:,} bytes by the archive's own directory")

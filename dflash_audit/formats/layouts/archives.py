"""NeMo `.nemo` archives: a tar (optionally gzipped) holding `model_weights.ckpt` and `model_config.yaml`.

Nothing is extracted where the archive says: the config is read in memory, and the weights are
copied, size-bounded, into a temporary folder this tool creates and removes, under a name of its
own, so no member name can reach outside it. Only regular-file members are read (never links or
devices). A model-parallel archive (`mp_rank_00/model_weights.ckpt`, ...) or one holding a
distributed checkpoint (`model_weights/.metadata`) is refused, naming what was found.
"""

from __future__ import annotations

import re
import tarfile
import tempfile
from pathlib import Path
from typing import Any

from dflash_audit.formats.payload import EntryError, Payload, split_payload
from dflash_audit.formats.safe_pickle import UnsafePickle, safe_load
from dflash_audit.formats.safe_yaml import describe, read_settings, settings_mapping
from foundation.decompression import DecompressionBomb, check_stated
from foundation.errors import CheckpointError

WEIGHTS = "model_weights.ckpt"
CONFIG = "model_config.yaml"
MAX_CONFIG_BYTES = 16 << 20
MAX_WEIGHT_BYTES = 256 << 30  # far above any drafter: a bound on a corrupt or hostile size field
CHUNK = 16 << 20
RANK_WEIGHTS = re.compile(r"^(mp_rank_\d+|tp_rank_\d+(_pp_rank_\d+)?)/" + re.escape(WEIGHTS) + "$")


def detect(path: Path) -> bool:
    return path.is_file() and path.name.endswith(".nemo")


def member_name(member: tarfile.TarInfo) -> str:
    return member.name.removeprefix("./").strip("/")


def members_of(path: Path, archive: tarfile.TarFile) -> dict[str, tarfile.TarInfo]:
    return {member_name(m): m for m in archive.getmembers()}


def copy_member(archive: tarfile.TarFile, member: tarfile.TarInfo, dest: Path, archive_path: Path) -> None:
    if member.size > MAX_WEIGHT_BYTES:
        raise CheckpointError(f"{archive_path}: {member_name(member)} claims {member.size} bytes; refusing it")
    try:  # a gzipped archive's member past what its size on disk can hold: a bomb, never copied out
        check_stated(archive_path, member.size, MAX_WEIGHT_BYTES)
    except DecompressionBomb as exc:
        raise CheckpointError(f"{archive_path}: {member_name(member)}: {exc}") from None
    source = archive.extractfile(member)
    if source is None:
        raise CheckpointError(f"{archive_path}: {member_name(member)} is not a regular file")
    copied = 0
    with source, open(dest, "wb") as out:
        while chunk := source.read(min(CHUNK, member.size - copied + 1)):
            copied += len(chunk)
            if copied > member.size:
                raise CheckpointError(f"{archive_path}: {member_name(member)} holds more than its stated size")
            out.write(chunk)


def read_config(archive: tarfile.TarFile, member: tarfile.TarInfo, path: Path) -> dict[str, Any]:
    if not member.isfile() or member.size > MAX_CONFIG_BYTES:
        raise CheckpointError(f"{path}: {CONFIG} is not a regular file of at most {MAX_CONFIG_BYTES >> 20} MiB")
    where = f"{path}: {CONFIG}"
    return settings_mapping(read_settings(archive.extractfile(member).read(MAX_CONFIG_BYTES), where, "yaml"), where)


def read(path: Path, entry: str | None, entry_flag: str) -> tuple[Payload, list[tuple[str, dict[str, Any]]]]:
    """The weights' payload and the archive's config as a declaration source."""
    try:
        archive = tarfile.open(path, mode="r:*")
    except (tarfile.TarError, OSError, EOFError) as exc:
        raise CheckpointError(f"{path}: not a readable .nemo archive (a tar file): {describe(exc)}") from exc
    with archive:
        members = members_of(path, archive)
        weights = members.get(WEIGHTS)
        if weights is None:
            sharded = sorted(n for n in members if RANK_WEIGHTS.match(n))
            distributed = sorted(n for n in members if n.endswith(".metadata") or n.endswith(".distcp"))
            if sharded:
                raise CheckpointError(f"{path}: a model-parallel .nemo archive ({', '.join(sharded[:3])}); merge its "
                                      "ranks into one (NeMo's restore with tensor/pipeline size 1, then save_to) and "
                                      "pass that archive")
            if distributed:
                raise CheckpointError(f"{path}: holds a distributed checkpoint ({distributed[0]}); extract the "
                                      "archive and pass the folder holding .metadata")
            raise CheckpointError(f"{path}: no {WEIGHTS} in the archive (members: {sorted(members)[:6]})")
        if not weights.isfile():
            raise CheckpointError(f"{path}: {WEIGHTS} is not a regular file in the archive (a link?); refusing it")
        declarations = []
        if CONFIG in members:
            declarations.append((f"{path.name}: {CONFIG}:", read_config(archive, members[CONFIG], path)))
        with tempfile.TemporaryDirectory(prefix="dflash-audit-nemo-") as scratch:
            local = Path(scratch) / "weights.ckpt"
            copy_member(archive, weights, local, path)
            try:
                data = safe_load(local)
            except UnsafePickle as exc:
                raise CheckpointError(f"{path}: {WEIGHTS}: {exc}") from exc
            except Exception as exc:
                raise CheckpointError(f"{path}: {WEIGHTS} is not a readable torch checkpoint "
                                      f"({describe(exc)})") from exc
            try:
                payload = split_payload(data, entry, entry_flag)
            except EntryError as exc:
                raise CheckpointError(f"{path}: {WEIGHTS}: {exc}") from exc
            # The copy is removed on leaving: own every tensor (they may be mapped from it).
            payload.tensors = {k: v.clone() for k, v in payload.tensors.items()}
    return payload, declarations

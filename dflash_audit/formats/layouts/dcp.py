"""torch.distributed.checkpoint folders (`.metadata` + `*.distcp`), as FSDP2, torchtitan, NeMo AutoModel
and Megatron's `torch_dist` format write them, read in this one process without a process group.

torch's own reader reads the data (`FileSystemReader` with `no_dist=True`); two of its steps would
run a plain `pickle.load` on what the folder holds, so both are replaced: the `.metadata` file goes
through `safe_pickle.RestrictedUnpickler`, which resolves only the DCP metadata classes, and each
non-tensor item through `torch.load(weights_only=True)`. The state dict's structure comes from the
metadata alone (tensors as shapes on the `meta` device), so the drafter's entry is picked by the same
rules as a training dict's and only its tensors are ever read; optimizer state is named, not loaded.
"""

from __future__ import annotations

import io
import pathlib
from pathlib import Path
from typing import Any

import torch

from dflash_audit.formats.payload import EntryError, Payload, split_payload
from dflash_audit.formats.safe_pickle import UnsafePickle, restricted_load
from dflash_audit.formats.safe_yaml import describe
from foundation.errors import CheckpointError

METADATA = ".metadata"
NOT_PLAIN = "<not plain data: not read>"


def detect(path: Path) -> bool:
    return path.is_dir() and (path / METADATA).is_file()


def metadata_globals() -> dict[tuple[str, str], Any]:
    """The only globals a DCP `.metadata` pickle names: its own dataclasses, sizes, dtypes, layouts, paths."""
    from torch.distributed.checkpoint import filesystem, metadata
    from torch.serialization import _get_layout

    allowed: dict[tuple[str, str], Any] = {
        ("torch.distributed.checkpoint.metadata", name): getattr(metadata, name)
        for name in ("Metadata", "MetadataIndex", "TensorStorageMetadata", "BytesStorageMetadata",
                     "ChunkStorageMetadata", "TensorProperties", "StorageMeta", "_MEM_FORMAT_ENCODING")
        if hasattr(metadata, name)}
    allowed[("torch.distributed.checkpoint.filesystem", "_StorageInfo")] = filesystem._StorageInfo
    allowed[("torch", "Size")] = torch.Size
    allowed[("torch.serialization", "_get_layout")] = _get_layout  # a name -> torch.layout lookup
    allowed.update({("torch", name): getattr(torch, name) for name in dir(torch)
                    if isinstance(getattr(torch, name, None), torch.dtype)})
    allowed.update({("pathlib", name): getattr(pathlib, name) for name in ("Path", "PosixPath", "WindowsPath",
                                                                          "PurePosixPath", "PureWindowsPath")})
    allowed.update({("pathlib._local", name): getattr(pathlib, name) for name in ("PosixPath", "WindowsPath")})
    allowed[("collections", "OrderedDict")] = dict
    return allowed


def read_metadata(folder: Path):
    from torch.distributed.checkpoint.metadata import Metadata

    try:
        metadata = restricted_load(folder / METADATA, metadata_globals())
    except UnsafePickle as exc:
        raise CheckpointError(f"{folder / METADATA}: {exc}") from exc
    except Exception as exc:  # a truncated or foreign file
        raise CheckpointError(f"{folder / METADATA}: not a readable torch.distributed.checkpoint metadata file "
                              f"({describe(exc)})") from exc
    if not isinstance(metadata, Metadata) or not isinstance(metadata.state_dict_metadata, dict):
        raise CheckpointError(f"{folder / METADATA}: not a torch.distributed.checkpoint metadata file")
    return metadata


def reader_for(folder: Path, metadata):
    """torch's FileSystemReader, handed the metadata read above instead of unpickling it itself."""
    from torch.distributed.checkpoint import FileSystemReader

    class SafeMetadataReader(FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            return metadata

    return SafeMetadataReader(str(folder))


def planner_for(keys: set[str]):
    """torch's planner that rebuilds the state dict from the metadata, limited to `keys`, with
    non-tensor items read by `torch.load(weights_only=True)` instead of a plain unpickling."""
    from torch.distributed.checkpoint._traverse import set_element
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner

    class TensorsOnlyPlanner(_EmptyStateDictLoadPlanner):
        def load_bytes(self, read_item, value: io.BytesIO) -> None:
            try:
                loaded = torch.load(value, map_location="cpu", weights_only=True)
            except Exception:  # a class torch's safe loader refuses: named, never run
                loaded = NOT_PLAIN
            fqn = read_item.dest_index.fqn
            if self.flatten_state_dict and fqn in self.mappings:
                set_element(self.original_state_dict, self.mappings[fqn], loaded)
            else:
                self.state_dict[fqn] = loaded

    return TensorsOnlyPlanner(keys=keys)


def load_keys(folder: Path, metadata, keys: set[str]) -> dict[str, Any]:
    """The named flat keys, read through torch's reader; returns the nested state dict."""
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    state: dict[str, Any] = {}
    if not keys:
        return state
    try:
        _load_state_dict(state, storage_reader=reader_for(folder, metadata), planner=planner_for(keys), no_dist=True)
    except CheckpointError:
        raise
    except Exception as exc:  # a missing or truncated *.distcp file
        raise CheckpointError(f"{folder}: the *.distcp data cannot be read ({describe(exc)})") from exc
    return state


def path_of(metadata, fqn: str) -> tuple:
    planner_data = metadata.planner_data if isinstance(metadata.planner_data, dict) else {}
    return tuple(planner_data.get(fqn, (fqn,)))


def get_path(tree: Any, path: tuple) -> Any:
    for part in path:
        tree = tree[part]
    return tree


def set_path(tree: dict, path: tuple, value: Any) -> None:
    for part in path[:-1]:
        tree = tree.setdefault(part, {})
    tree[path[-1]] = value


def check_storage_paths(folder: Path, metadata) -> None:
    """Every data file the metadata names lies inside the folder (never `../elsewhere`), is there and is
    long enough for the items it should hold."""
    root = folder.resolve()
    ends: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        relative = getattr(info, "relative_path", None)
        if not isinstance(relative, str) or root not in (root / relative).resolve().parents:
            raise CheckpointError(f"{folder / METADATA}: names data outside its folder ({relative!r}); refusing it")
        ends[relative] = max(ends.get(relative, 0), int(info.offset) + int(info.length))
    for relative, end in sorted(ends.items()):
        data = folder / relative
        if not data.is_file():
            raise CheckpointError(f"{folder}: the *.distcp data cannot be read ({relative} is missing; the metadata "
                                  "names it)")
        if data.stat().st_size < end:
            raise CheckpointError(f"{folder}: the *.distcp data cannot be read ({relative} is truncated: "
                                  f"{data.stat().st_size} bytes, the metadata needs {end})")


def top_level_model(skeleton: dict[str, Any], entry_flag: str) -> Payload | None:
    """torchtitan's layout: the model's tensors at the top level, beside `optimizer`, `lr_scheduler`,
    `train_state`, `dataloader` entries (which are accounted for as in a training dict)."""
    tensors = {k: v for k, v in skeleton.items() if isinstance(v, torch.Tensor)}
    if not tensors:
        return None
    rest = {k: v for k, v in skeleton.items() if k not in tensors}
    payload = split_payload({TOP_LEVEL: tensors, **rest}, TOP_LEVEL, entry_flag)
    payload.entry = None
    return payload


TOP_LEVEL = "<top level>"


def read(folder: Path, entry: str | None, entry_flag: str) -> tuple[Payload, list[Path]]:
    """The drafter's state dict (raw names), the other entries accounted for, and the files read."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = read_metadata(folder)
    check_storage_paths(folder, metadata)
    items = metadata.state_dict_metadata
    tensor_keys = {k for k, v in items.items() if isinstance(v, TensorStorageMetadata)}
    # Non-tensor items (training args, step counters) are small: read them all, as data.
    skeleton = load_keys(folder, metadata, set(items) - tensor_keys)
    by_id: dict[int, str] = {}
    for fqn in sorted(tensor_keys):
        spec = items[fqn]
        shaped = torch.empty(tuple(spec.size), dtype=spec.properties.dtype, device="meta")
        by_id[id(shaped)] = fqn
        set_path(skeleton, path_of(metadata, fqn), shaped)
    if not tensor_keys:
        raise CheckpointError(f"{folder}: a torch.distributed.checkpoint folder with no tensors in it")
    try:
        payload = split_payload(skeleton, entry, entry_flag)
    except EntryError as exc:
        payload = top_level_model(skeleton, entry_flag) if entry is None else None
        if payload is None:
            raise CheckpointError(f"{folder}: {exc}") from exc
    wanted = {name: by_id[id(t)] for name, t in payload.tensors.items()}
    loaded = load_keys(folder, metadata, set(wanted.values()))
    payload.tensors = {name: get_path(loaded, path_of(metadata, fqn)) for name, fqn in wanted.items()}
    files = sorted({folder / info.relative_path for info in (metadata.storage_data or {}).values()
                    if hasattr(info, "relative_path")})
    return payload, [folder / METADATA] + files

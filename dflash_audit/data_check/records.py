"""The records of an offline hidden-state dataset, as the field's writers lay them out, read one at a time.

Three layouts (`detect_layout`):
- `vllm`: vLLM's `extract_hidden_states` files (`ExampleHiddenStatesConnector._submit_async_write`,
  vllm/distributed/kv_transfer/kv_connector/v1/example_hidden_states_connector.py:415-418): one safetensors file per
  request holding `hidden_states` [T, L, H] (the captured layers stacked in the order of the speculative config's
  `eagle_aux_hidden_state_layer_ids`) and `token_ids` [T];
- `speculators`: the same files renamed `hs_<i>.safetensors` by speculators' data generation
  (speculators/cli/generate_offline_data.py:139-159), in the folder itself or in its `hidden_states/` beside the
  preprocessed `datasets` folder whose row i holds record i's `input_ids` and `loss_mask`
  (speculators/train/data.py:314-332 reads them so);
- `specforge`: SpecForge's pickled `.ckpt` / `.ckpt.gz` records of `input_ids`, `loss_mask` and `hidden_states`
  [T, L*H] or [1, T, L*H] (specforge/algorithms/common/dflash_family_data.py:37-67), read with
  `torch.load(weights_only=True)` only: a record that needs more is refused, and nothing in it runs.

A record is read whole only when the check reaches it: the memory held is one record (plus the target).
"""

from __future__ import annotations

import gzip
import io
import re
import warnings
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import torch

from foundation.decompression import DecompressionBomb, check_zip, read_bounded
from foundation.errors import AuditError
from foundation.inputs import check_no_special_files, openable

LAYOUTS = ("vllm", "speculators", "specforge")
SPECFORGE_SUFFIXES = (".ckpt", ".ckpt.gz")
HS_FILE = re.compile(r"^hs_(\d+)\.safetensors$")
# A gzipped SpecForge record is decompressed into memory: past this it is no record of one sequence (and below
# it, foundation.decompression's bound on how far a file may expand holds first).
MAX_GZ_BYTES = 8 << 30
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def _integer(kind) -> bool:
    import pyarrow.types as kinds

    return kinds.is_integer(kind)


def _mask_value(kind) -> bool:
    import pyarrow.types as kinds

    return kinds.is_integer(kind) or kinds.is_boolean(kind) or kinds.is_floating(kind)


# speculators' preprocessed table: each column read, what a row of it holds, and the item types that hold it.
TABLE_COLUMNS = {"input_ids": ("a list of integer token ids", _integer),
                 "loss_mask": ("a list of 0/1 values", _mask_value)}


@dataclass
class Record:
    """One stored sequence: its token ids and every stored layer, as [T, H] tensors in stored order."""
    name: str
    token_ids: torch.Tensor  # [T] int64
    layers: list[torch.Tensor]  # each [T_h, H], as stored (dtype kept)
    dtype: str
    loss_mask: torch.Tensor | None = None  # [T'] as stored, or None when the dataset carries none
    extra: dict[str, torch.Tensor] = field(default_factory=dict)  # e.g. SpecForge DSpark's target_last_hidden_states


@dataclass
class Dataset:
    folder: Path
    layout: str
    files: list[Path]  # every record file, in the writer's order
    rows: object = None  # speculators: the preprocessed `datasets` table (input_ids, loss_mask per file index)

    def __len__(self) -> int:
        return len(self.files)

    def sample(self, count: int) -> list[int]:
        """`count` record indices spread evenly over the dataset (all of them when it holds fewer)."""
        total = len(self.files)
        if count >= total:
            return list(range(total))
        return sorted({round(i * (total - 1) / (count - 1)) for i in range(count)}) if count > 1 else [0]

    def read(self, index: int) -> Record:
        path = self.files[index]
        if self.layout == "specforge":
            return read_specforge(path)
        record = read_safetensors(path)
        if self.rows is not None:
            attach_speculators_row(record, self.rows, path)
        return record


def is_record_name(name: str) -> bool:
    return name.endswith(".safetensors") or name.endswith(SPECFORGE_SUFFIXES)


def file_order(path: Path) -> tuple:
    found = HS_FILE.match(path.name)
    return (0, int(found.group(1)), path.name) if found else (1, 0, path.name)


def detect_layout(folder: Path) -> Dataset:
    """The dataset in `folder` (a folder of records, or one record file); one line and exit 2 otherwise."""
    folder = Path(folder)
    if not folder.exists():
        raise AuditError(f"{folder}: no such file or folder")
    if folder.is_file():
        if not is_record_name(folder.name):  # one file given: it must be a record, not any file of the dataset
            raise AuditError(f"{folder}: not a hidden-state record by its name (a *.safetensors from vLLM or "
                             "speculators, a *.ckpt / *.ckpt.gz from SpecForge); give a record or the dataset folder")
        files = [folder]
        base = folder.parent
    elif folder.is_dir():
        check_no_special_files(folder, "in the dataset folder")
        base = folder
        inner = folder / "hidden_states"
        source = inner if inner.is_dir() and any(inner.glob("hs_*.safetensors")) else folder
        if source is inner:
            check_no_special_files(inner, "in the dataset's hidden_states folder")
        named = [p for p in source.iterdir() if is_record_name(p.name)]
        unreadable = sorted(p for p in named if not p.is_file())
        if unreadable:  # a record never silently skipped: a folder, a broken link or a link loop under its name
            raise AuditError(f"{unreadable[0]}: named as a record but not a readable file ("
                             f"{'a broken link or a link loop' if unreadable[0].is_symlink() else 'a folder'})")
        files = sorted(named, key=file_order)
    else:
        raise AuditError(f"{folder}: not a regular file or folder")
    pickled = [p for p in files if p.name.endswith(SPECFORGE_SUFFIXES)]
    tensors = [p for p in files if p.name.endswith(".safetensors")]
    if pickled and tensors:
        raise AuditError(f"{folder}: holds both safetensors records ({tensors[0].name}) and SpecForge pickles "
                         f"({pickled[0].name}); give one dataset at a time")
    if not files:
        raise AuditError(f"{folder}: no hidden-state records (*.safetensors from vLLM or speculators, "
                         "*.ckpt / *.ckpt.gz from SpecForge)")
    if pickled:
        return Dataset(folder, "specforge", pickled)
    layout = "speculators" if all(HS_FILE.match(p.name) for p in tensors) else "vllm"
    rows = speculators_rows(base) if layout == "speculators" and tensors[0].parent != base else None
    return Dataset(folder, layout, tensors, rows)


def speculators_rows(base: Path):
    """speculators' preprocessed dataset beside `hidden_states/` (its `datasets` save_to_disk folder), or None."""
    if not (base / "dataset_info.json").is_file() and not (base / "state.json").is_file():
        return None
    try:
        from datasets import load_from_disk

        rows = load_from_disk(openable(base))
    except Exception as exc:  # noqa: BLE001 -- any failure of the table is the dataset's
        raise AuditError(f"{base}: cannot read speculators' preprocessed dataset ({' '.join(str(exc).split())[:200]})"
                         ) from None
    missing = {"input_ids", "loss_mask"} - set(getattr(rows, "column_names", []))
    if missing:
        raise AuditError(f"{base}: speculators' preprocessed dataset has no column {sorted(missing)[0]!r}")
    check_columns(rows, base)
    return rows.with_format("torch")


def check_columns(rows, base: Path) -> None:
    """Each column read holds what speculators' preprocessing writes (a list of integers a row), by the table's own
    schema, before any row is read: a column of strings, of scalars or of nested lists is one line naming it."""
    import pyarrow.types as kinds

    for name, (words, fits) in TABLE_COLUMNS.items():
        column = rows.features.arrow_schema.field(name).type
        listed = kinds.is_list(column) or kinds.is_large_list(column) or kinds.is_fixed_size_list(column)
        if not (listed and fits(column.value_type)):
            raise AuditError(f"{base}: speculators' preprocessed dataset column {name!r} holds {arrow_words(column)} "
                             f"in each row; expected {words}")
        row = first_null_row(rows.data.column(name))
        if row is not None:  # a null (a row, or an item of one) reads back as NaN or nothing: never a token id
            raise AuditError(f"{base}: speculators' preprocessed dataset column {name!r} holds a null in row {row}; "
                             f"expected {words}")


def first_null_row(column) -> int | None:
    """The first row of a list column that is null or holds a null, or None."""
    import pyarrow.compute as compute

    column = column.combine_chunks()
    nulls = compute.is_null(column)
    items = compute.is_null(compute.list_flatten(column))
    if not compute.any(nulls).as_py() and not compute.any(items).as_py():
        return None
    parents = compute.list_parent_indices(column).to_numpy()
    rows = [int(i) for i in compute.indices_nonzero(nulls).to_numpy()]
    rows += [int(parents[i]) for i in compute.indices_nonzero(items).to_numpy()]
    return min(rows)


def arrow_words(kind, plural: bool = False) -> str:
    """A table column's type as a message says it ('a string', 'a list of lists of integers')."""
    import pyarrow.types as kinds

    if kinds.is_list(kind) or kinds.is_large_list(kind) or kinds.is_fixed_size_list(kind):
        return f"{'lists' if plural else 'a list'} of {arrow_words(kind.value_type, plural=True)}"
    for test, one, many in ((kinds.is_string, "a string", "strings"), (kinds.is_large_string, "a string", "strings"),
                            (kinds.is_integer, "an integer", "integers"), (kinds.is_floating, "a float", "floats"),
                            (kinds.is_boolean, "a true/false value", "true/false values"),
                            (kinds.is_null, "a null", "nulls"), (kinds.is_binary, "a byte string", "byte strings"),
                            (kinds.is_struct, "a record", "records")):
        if test(kind):
            return many if plural else one
    return f"{kind} values" if plural else f"a {kind} value"


def attach_speculators_row(record: Record, rows, path: Path) -> None:
    """Row i of the preprocessed table: its loss_mask, and its input_ids held to the file's token ids as speculators'
    loader holds them (train/data.py:314, a mismatch makes the sample unavailable)."""
    index = int(HS_FILE.match(path.name).group(1))
    if index >= len(rows):
        raise AuditError(f"{path}: record {index} has no row in speculators' preprocessed dataset "
                         f"({len(rows)} rows)")
    row = rows[index]  # its columns' kinds and nulls checked with the table (`check_columns`)
    record.loss_mask = row["loss_mask"].reshape(-1)
    record.extra["input_ids"] = row["input_ids"].reshape(-1)


def refuse(path: Path, why: str) -> AuditError:
    return AuditError(f"{path}: {why}")


def read_safetensors(path: Path) -> Record:
    """A vLLM / speculators record: the header checked (keys, ranks, dtypes) before any tensor is read."""
    from safetensors import safe_open

    try:
        with safe_open(openable(path), framework="pt") as handle:
            keys = set(handle.keys())
            missing = {"hidden_states", "token_ids"} - keys
            if missing:
                raise refuse(path, f"no {sorted(missing)[0]!r} tensor (a vLLM extract_hidden_states record holds "
                                   "hidden_states and token_ids)")
            shape = list(handle.get_slice("hidden_states").get_shape())
            if len(shape) not in (2, 3):
                raise refuse(path, f"hidden_states has shape {shape}; vLLM writes [tokens, layers, hidden]")
            hidden = handle.get_tensor("hidden_states")
            ids = handle.get_tensor("token_ids")
    except AuditError:
        raise
    except Exception as exc:  # noqa: BLE001 -- safetensors' own refusal of a corrupt file, in one line
        raise refuse(path, f"not a readable safetensors file ({' '.join(str(exc).split())[:200]})") from None
    if hidden.dim() == 2:  # one layer stored flat: [T, H]
        hidden = hidden[:, None]
    if hidden.shape[1] == 0 or hidden.shape[2] == 0:
        raise refuse(path, f"hidden_states has shape {list(hidden.shape)}: no layer stored")
    return Record(path.name, check_ids(path, ids), [hidden[:, j] for j in range(hidden.shape[1])],
                  check_float(path, hidden))


def load_pickle(path: Path):
    from foundation.pickle_limits import PickleBomb, check_graph, load_failure_reason

    try:
        with warnings.catch_warnings():  # torch's warning about a pickle's protocol: the refusal below says it all
            warnings.simplefilter("ignore")
            loaded = torch_load(path)
        check_graph(loaded)
    except AuditError:
        raise
    except PickleBomb as exc:
        raise refuse(path, f"{exc}; refusing to read it further (nothing was run)") from None
    except Exception as exc:  # noqa: BLE001 -- torch's refusal (an unsafe global, a corrupt archive), in one line
        raise refuse(path, f"cannot be read with torch.load(weights_only=True): {load_failure_reason(exc)}; "
                           "refusing it (nothing in it was run)") from None
    return loaded


def torch_load(path: Path):
    """`torch.load(weights_only=True)` of a record: paged in where it is torch's zip format, a legacy pickle read
    whole, a gzipped one decompressed in memory within foundation.decompression's bound (never past MAX_GZ_BYTES).
    A compressed file past it is a decompression bomb, refused naming the sizes."""
    try:
        if path.name.endswith(".gz"):
            with gzip.open(openable(path), "rb") as handle:
                data = read_bounded(handle, path.stat().st_size, MAX_GZ_BYTES)
            return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        zipped = zipfile.is_zipfile(openable(path))
        if zipped:
            check_zip(openable(path), MAX_GZ_BYTES)
        return torch.load(openable(path), map_location="cpu", weights_only=True, mmap=zipped)
    except DecompressionBomb as exc:
        raise refuse(path, str(exc)) from None


def read_specforge(path: Path) -> Record:
    raw = load_pickle(path)
    if not isinstance(raw, dict):
        raise refuse(path, f"holds a {type(raw).__name__}, not SpecForge's record dict (input_ids, loss_mask, "
                           "hidden_states)")
    key = "hidden_states" if "hidden_states" in raw else "aux_hidden_state" if "aux_hidden_state" in raw else None
    if key is None or "input_ids" not in raw:
        raise refuse(path, f"no {'input_ids' if 'input_ids' not in raw else 'hidden_states'!r} entry (SpecForge's "
                           "DFlash records hold input_ids, loss_mask and hidden_states)")
    for name in ("input_ids", key, "loss_mask"):
        if name in raw and not isinstance(raw[name], torch.Tensor):
            raise refuse(path, f"entry {name!r} is a {type(raw[name]).__name__}, not a tensor")
    hidden = raw[key]
    if hidden.dim() == 3 and hidden.shape[0] == 1:
        hidden = hidden[0]
    if hidden.dim() != 2:
        raise refuse(path, f"{key} has shape {list(hidden.shape)}; SpecForge writes [tokens, layers x hidden] "
                           "or [1, tokens, layers x hidden]")
    mask = raw.get("loss_mask")
    record = Record(path.name, check_ids(path, raw["input_ids"]), [hidden], check_float(path, hidden),
                    mask.reshape(-1) if isinstance(mask, torch.Tensor) else None)
    for name in ("target_last_hidden_states", "hidden_state"):  # DSpark's final states, EAGLE-3's target state
        if isinstance(raw.get(name), torch.Tensor):
            record.extra[name] = raw[name]
    return record


def check_ids(path: Path, ids: torch.Tensor) -> torch.Tensor:
    if ids.dim() == 2 and ids.shape[0] == 1:
        ids = ids[0]
    if ids.dim() != 1 or ids.dtype.is_floating_point or ids.dtype == torch.bool or ids.is_complex():
        raise refuse(path, f"token ids of shape {list(ids.shape)} and dtype {str(ids.dtype).removeprefix('torch.')};"
                           " expected one row of integer ids")
    if ids.numel() and int(ids.min()) < 0:
        raise refuse(path, f"a negative token id ({int(ids.min())})")
    return ids.long()


def check_float(path: Path, hidden: torch.Tensor) -> str:
    if hidden.dtype not in FLOAT_DTYPES:
        raise refuse(path, f"hidden states of dtype {str(hidden.dtype).removeprefix('torch.')}; a writer stores "
                           "floating-point states")
    return str(hidden.dtype).removeprefix("torch.")


def split_flat(record: Record, hidden_size: int, path_name: str) -> None:
    """A SpecForge record's [T, L*H] as L layers of [T, H] (the target's hidden size decides L)."""
    (flat,) = record.layers
    if flat.shape[-1] == 0 or flat.shape[-1] % hidden_size:
        raise AuditError(f"{path_name}: hidden states {flat.shape[-1]} wide, not a multiple of the target's hidden "
                         f"size {hidden_size} (not this target's states)")
    record.layers = [flat[:, j * hidden_size:(j + 1) * hidden_size] for j in range(flat.shape[-1] // hidden_size)]

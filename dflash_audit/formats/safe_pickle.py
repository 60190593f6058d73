"""Reading a training checkpoint's pickle without running any of its code.

Training files pickle more than tensors: their args (`argparse.Namespace`, dataclass or
OmegaConf configs, `pathlib` paths, numpy scalars). `torch.load(weights_only=True)` refuses
every class it does not know, so such a file is read in two steps:

1. an explicit list of plain-data types is admitted through torch's safe-globals mechanism
   (`PLAIN_DATA`): constructing them runs only the standard library's or numpy's code;
2. any other *class* the file names is replaced by an `Opaque` stand-in registered under its
   name: its module is never imported, so none of its code runs; the stand-in records the
   constructor arguments and pickled state, which `to_plain` turns back into plain data.

A global that is not class-like (a function such as `posix.system` or `builtins.eval`, the
usual `__reduce__` payload), or that comes from a module that only a payload would name,
refuses the whole file, naming it.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import pathlib
import pickle
import re
import zipfile
from pathlib import Path
from typing import Any

import numpy
import torch

from foundation.decompression import MAX_EXPANDED_BYTES, DecompressionBomb, check_zip
from foundation.inputs import openable
from foundation.pickle_limits import PickleBomb, check_graph

try:  # numpy 2 moved its core; pickles name either place
    from numpy._core import multiarray
except ImportError:  # pragma: no cover - numpy 1.x
    from numpy.core import multiarray

# Plain-data types admitted as themselves (their reconstruction runs trusted library code only).
PLAIN_DATA: list[Any] = [
    argparse.Namespace, collections.OrderedDict, collections.defaultdict, collections.Counter,
    pathlib.Path, pathlib.PosixPath, pathlib.WindowsPath, pathlib.PurePath, pathlib.PurePosixPath,
    pathlib.PureWindowsPath, datetime.datetime, datetime.date, datetime.time, datetime.timedelta,
    dict, list, tuple, set, frozenset, int, float, str, bool, bytes, complex, slice, range, object,
    numpy.dtype, numpy.ndarray, multiarray.scalar, multiarray._reconstruct,
]
PLAIN_DATA += [getattr(numpy.dtypes, name) for name in dir(numpy.dtypes) if name.endswith("DType")]
# The names they are pickled under where that differs from where they live now.
PLAIN_DATA_ALIASES: list[tuple[Any, str]] = [
    (multiarray.scalar, "numpy.core.multiarray.scalar"),
    (multiarray.scalar, "numpy._core.multiarray.scalar"),
    (multiarray._reconstruct, "numpy.core.multiarray._reconstruct"),
    (multiarray._reconstruct, "numpy._core.multiarray._reconstruct"),
    (pathlib.PosixPath, "pathlib._local.PosixPath"), (pathlib.WindowsPath, "pathlib._local.WindowsPath"),
    (pathlib.PurePosixPath, "pathlib._local.PurePosixPath"), (pathlib.PureWindowsPath, "pathlib._local.PureWindowsPath"),
    (collections.OrderedDict, "builtins.OrderedDict"),
]
# Modules whose names a plain-data pickle never needs: a class from one of these is refused,
# not stood in for (nothing would run either way, but such a file is not a training checkpoint).
REFUSED_MODULES = {"builtins", "os", "posix", "nt", "sys", "subprocess", "shutil", "socket", "importlib", "runpy",
                   "code", "codecs", "pickle", "marshal", "ctypes", "multiprocessing", "webbrowser", "pty", "signal",
                   "io", "tempfile", "types", "functools", "operator", "platform", "urllib", "http", "ftplib",
                   "smtplib", "telnetlib", "asyncio", "threading", "_thread", "torch", "numpy", "pathlib", "typing_extensions"}
MAX_STAND_INS = 256
GLOBAL_NAME = re.compile(r"GLOBAL ([\w.]+)")


class UnsafePickle(ValueError):
    """The file names a global that is neither plain data nor a class we can stand in for."""

    def __init__(self, name: str, why: str):
        self.name = name
        super().__init__(f"it pickles {name}, {why}; refusing to load it (nothing was run)")


class PickleTooLarge(UnsafePickle):
    """An unpickled graph past foundation.pickle_limits' limits (a reference bomb, a loop, absurd nesting)."""

    def __init__(self, why: str):
        self.name = ""
        ValueError.__init__(self, f"{why}; refusing to read it further (nothing was run)")


class Opaque:
    """Stand-in for a class the file names: never imports it, only records what was pickled."""

    qualified_name = "?"

    def __new__(cls, *args, **kwargs):
        instance = object.__new__(cls)
        instance.__dict__["_opaque_args"] = args
        instance.__dict__["_opaque_state"] = None
        return instance

    def __init__(self, *args, **kwargs):
        pass

    def __setstate__(self, state):
        self.__dict__["_opaque_state"] = state

    def __repr__(self) -> str:
        return f"<{self.qualified_name} (read as data)>"


def stand_in(name: str) -> type:
    module, _, short = name.rpartition(".")
    if not module or not short[:1].isupper():
        raise UnsafePickle(name, "which is a function call, not a class of plain data")
    if module.split(".")[0] in REFUSED_MODULES:
        raise UnsafePickle(name, f"and no training checkpoint needs a class from {module}")
    return type(short, (Opaque,), {"qualified_name": name, "__module__": "dflash_audit.formats.safe_pickle"})


def _allowed() -> list[Any]:
    return PLAIN_DATA + PLAIN_DATA_ALIASES


def unsafe_globals(path: Path) -> list[str]:
    """Globals the file names beyond torch's own allowlist (zip checkpoints; [] for others)."""
    if not zipfile.is_zipfile(path):
        return []
    with torch.serialization.safe_globals(_allowed()):
        return list(torch.serialization.get_unsafe_globals_in_checkpoint(str(path)))


def safe_load(path: Path) -> Any:
    """The unpickled payload, tensors on CPU (mmapped where the file allows); raises UnsafePickle."""
    stand_ins: dict[str, type] = {}
    for name in unsafe_globals(path):
        stand_ins[name] = stand_in(name)
    mmap = zipfile.is_zipfile(path)
    if mmap:  # torch's reader inflates a compressed entry whole: a zip bomb is refused before it
        try:
            check_zip(openable(path), MAX_EXPANDED_BYTES)
        except DecompressionBomb as exc:
            raise PickleTooLarge(str(exc)) from None
    while True:
        allowed = _allowed() + [(cls, name) for name, cls in stand_ins.items()]
        try:
            with torch.serialization.safe_globals(allowed):
                data = torch.load(openable(path), map_location="cpu", weights_only=True, mmap=mmap)
            try:
                check_graph(data)  # before any reader walks it
            except PickleBomb as exc:
                raise PickleTooLarge(str(exc)) from None
            return data
        except pickle.UnpicklingError as exc:
            # Legacy (non-zip) files cannot be scanned ahead: learn their globals one refusal at a time.
            match = GLOBAL_NAME.search(str(exc))
            if match is None or match.group(1) in stand_ins or len(stand_ins) >= MAX_STAND_INS:
                raise
            stand_ins[match.group(1)] = stand_in(match.group(1))


def to_plain(value: Any, depth: int = 0, path: frozenset = frozenset()) -> Any:
    """Plain JSON-like data (dicts, lists, numbers, strings) from what `safe_load` returned; tensors kept.
    An object met again on its own path (a back-reference such as OmegaConf's parent) is not followed."""
    if depth > 50 or id(value) in path:
        return repr(value)
    if isinstance(value, (dict, list, tuple, set, frozenset, Opaque, argparse.Namespace)):
        path = path | {id(value)}
    if isinstance(value, numpy.generic):  # before float: numpy.float64 is a float
        return value.item()
    if isinstance(value, torch.Tensor) or value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, argparse.Namespace):
        return {k: to_plain(v, depth + 1, path) for k, v in vars(value).items()}
    if isinstance(value, pathlib.PurePath):
        return str(value)
    if isinstance(value, numpy.ndarray):
        return value.tolist()
    if isinstance(value, (datetime.date, datetime.time, datetime.timedelta)):
        return str(value)
    if isinstance(value, dict):
        return {str(k) if not isinstance(k, (int, str)) else k: to_plain(v, depth + 1, path) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [to_plain(v, depth + 1, path) for v in value]
    if isinstance(value, Opaque):
        return opaque_to_plain(value, depth, path)
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    return repr(value)


def opaque_to_plain(value: Opaque, depth: int, path: frozenset = frozenset()) -> Any:
    state, args = value.__dict__.get("_opaque_state"), value.__dict__.get("_opaque_args") or ()
    extra = {k: v for k, v in value.__dict__.items() if not k.startswith("_opaque_")}
    if isinstance(state, tuple) and len(state) == 2 and (state[0] is None or isinstance(state[0], dict)):
        state = {**(state[0] or {}), **(state[1] or {})}  # (dict, slots) form
    if isinstance(state, dict):
        extra.update(state)
    if "_content" in extra:  # an OmegaConf container: its values live in `_content`
        return to_plain(extra["_content"], depth + 1, path)
    if "_val" in extra:  # an OmegaConf value node
        return to_plain(extra["_val"], depth + 1, path)
    if extra:
        return {k: to_plain(v, depth + 1, path) for k, v in extra.items() if not k.startswith("__")}
    if len(args) == 1:  # an enum member or a one-value wrapper
        return to_plain(args[0], depth + 1, path)
    return {"class": value.qualified_name, "args": to_plain(list(args), depth + 1, path)}


class RestrictedUnpickler(pickle.Unpickler):
    """Plain `pickle` for files `torch.load` cannot read (e.g. a distributed checkpoint's `.metadata`):
    only the globals named in `allowed` ((module, name) -> object) resolve, so nothing else can be
    called or built; any other global refuses the file, naming it."""

    def __init__(self, stream, allowed: dict[tuple[str, str], Any]):
        super().__init__(stream)
        self.allowed = allowed

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self.allowed:
            return self.allowed[(module, name)]
        raise UnsafePickle(f"{module}.{name}", "which this file's format never pickles")


def restricted_load(path: Path, allowed: dict[tuple[str, str], Any]) -> Any:
    with open(path, "rb") as stream:
        data = RestrictedUnpickler(stream, allowed).load()
    try:
        check_graph(data)
    except PickleBomb as exc:
        raise PickleTooLarge(str(exc)) from None
    return data

"""Compare two implementations' outputs and describe any difference as a diff entry.

A `Comparator` is handed to every check. Each comparison is reported to a sink (the
session recorder, or the planted-bug harness) as pass / fail / references differ.
A failing comparison raises `Divergence` carrying its `DiffEntry`, so the test fails AND
the entry is recorded; a difference between two references is recorded, not raised; a call the plug
under test cannot take (`PlugMismatch`, conformance/plug.py) is recorded `plug-mismatch`, never a divergence.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import torch

from catalogue.pitfalls import PITFALLS
from conformance.plug import PlugMismatch
from conformance.tolerances import EXACT, Tolerance
from impl.interface import Unsupported

WINDOW = 4  # elements either side of the first difference shown in a diff entry
REFERENCES_DIFFER = "references differ"  # the status of two references that disagree


@dataclass
class DiffEntry:
    component: str
    pitfall: int
    implementations: tuple[str, str]
    message: str
    shapes: tuple[list[int] | None, list[int] | None] = (None, None)
    dtypes: tuple[str | None, str | None] = (None, None)
    max_abs: float | None = None
    max_rel: float | None = None
    first_index: list[int] | None = None
    values: tuple[Any, Any] = (None, None)
    window: dict[str, Any] = field(default_factory=dict)
    example: str = ""
    test: str = ""

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["implementations"] = list(self.implementations)
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DiffEntry:
        """The inverse of `to_dict` (pairs come back as tuples), for entries a pytest-xdist worker sent."""
        pairs = {name: tuple(data[name]) for name in ("implementations", "shapes", "dtypes", "values")}
        return cls(**{**data, **pairs})


class Divergence(AssertionError):
    """A comparison that failed; `entry` says where and by how much."""

    def __init__(self, entry: DiffEntry):
        self.entry = entry
        a, b = entry.implementations
        super().__init__(f"[{entry.component} #{entry.pitfall}] {a} vs {b}: {entry.message}")


def _as_tensor(value: Any) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    return torch.as_tensor(value)


def _plain(value: torch.Tensor) -> Any:
    return value.float().tolist() if value.is_floating_point() else value.tolist()


def _value_difference(actual: Any, expected: Any) -> dict[str, Any] | None:
    """Values that are not numbers (None, a string, a missing field) compare by equality."""
    try:
        same = actual is expected or (actual is not None and expected is not None and bool(actual == expected))
    except (TypeError, ValueError, RuntimeError):  # e.g. a tensor against a string
        same = False
    return None if same else {"message": f"{actual!r} != {expected!r}", "values": (repr(actual), repr(expected))}


def tensor_difference(actual: Any, expected: Any, tolerance: Tolerance) -> dict[str, Any] | None:
    """None when equal within `tolerance`, else the fields of a diff entry describing the difference."""
    if any(v is None or isinstance(v, str) for v in (actual, expected)):
        return _value_difference(actual, expected)
    try:
        a, b = _as_tensor(actual), _as_tensor(expected)
    except (TypeError, ValueError, RuntimeError):  # not numeric: a value of its own kind
        return _value_difference(actual, expected)
    shapes = (list(a.shape), list(b.shape))
    dtypes = (str(a.dtype), str(b.dtype))
    if a.shape != b.shape:
        return {"message": f"shape {shapes[0]} != {shapes[1]}", "shapes": shapes, "dtypes": dtypes}
    if a.numel() == 0:
        return None
    floating = a.is_floating_point() or b.is_floating_point()
    if floating:
        af, bf = a.double(), b.double()
        abs_diff = (af - bf).abs()
        abs_diff = torch.where(torch.isnan(af) & torch.isnan(bf), 0.0, abs_diff.nan_to_num(float("inf")))
        bad = abs_diff > tolerance.atol + tolerance.rtol * bf.abs()
    else:
        abs_diff = (a.long() - b.long()).abs().double() if a.dtype != torch.bool else (a != b).double()
        bad = a != b
    if not bool(bad.any()):
        return None
    rel = abs_diff / b.double().abs().clamp(min=1e-12)
    flat = int(bad.reshape(-1).nonzero()[0])
    index = [int(i) for i in torch.unravel_index(torch.tensor(flat), a.shape)] if a.ndim else []
    lo, hi = max(0, flat - WINDOW), flat + WINDOW + 1
    return {
        "message": f"{int(bad.sum())} of {a.numel()} elements differ"
                   + (f" beyond atol={tolerance.atol}, rtol={tolerance.rtol}" if not tolerance.exact else " (exact)"),
        "shapes": shapes, "dtypes": dtypes,
        "max_abs": float(abs_diff.max()), "max_rel": float(rel[bad].max()),
        "first_index": index,
        "values": (_plain(a.reshape(-1)[flat]), _plain(b.reshape(-1)[flat])),
        "window": {"flat_start": lo, "a": _plain(a.reshape(-1)[lo:hi]), "b": _plain(b.reshape(-1)[lo:hi])},
    }


Sink = Callable[[str, DiffEntry | None, dict[str, Any]], None]


class Comparator:
    """Runs comparisons for one test and reports each outcome to `sink(status, entry, key)`."""

    def __init__(self, sink: Sink, test: str, reference_names: frozenset[str], pitfall: int | None = None):
        self.sink = sink
        self.test = test
        self.reference_names = reference_names
        self.pitfall = pitfall  # the test's catalogue entry (its `pitfall` marker): what comparisons report under
        self.example = ""

    def _entry(self, pitfall: int | None) -> tuple[str, int]:
        """(component, catalogue entry) a comparison reports under: the test's own unless overridden."""
        pitfall = self.pitfall if pitfall is None else pitfall
        if pitfall is None:
            raise ValueError(f"{self.test}: no catalogue entry; mark the test with pytest.mark.pitfall(n)")
        return PITFALLS[pitfall].component, pitfall

    def describe(self, example: Any) -> None:
        """Remember the (hypothesis-generated) example so a failure can be reproduced from its entry."""
        self.example = repr(example)
        try:
            from hypothesis import note
            note(f"conformance example: {self.example}")
        except Exception:  # noqa: BLE001 - `note` outside a hypothesis test is a no-op concern only
            pass

    def not_applicable(self, names: tuple[str, str], reason: str, *, pitfall: int | None = None) -> None:
        component, pitfall = self._entry(pitfall)
        self.sink("n/a", None, {"component": component, "pitfall": pitfall, "implementations": list(names),
                                "test": self.test, "reason": reason})

    def plug_mismatch(self, names: tuple[str, str], message: str, *, pitfall: int | None = None) -> None:
        """Record a call the plug cannot take; the test goes on (what it could not run is not compared)."""
        component, pitfall = self._entry(pitfall)
        entry = DiffEntry(component=component, pitfall=pitfall, implementations=names, message=message,
                          example=self.example, test=self.test)
        self.sink("plug-mismatch", entry, {"component": component, "pitfall": pitfall,
                                           "implementations": list(names), "test": self.test})

    def compare(self, names: tuple[str, str], actual: Any, expected: Any, tolerance: Tolerance = EXACT,
                what: str = "", *, pitfall: int | None = None) -> DiffEntry | None:
        """Compare `actual` (names[0]) with `expected` (names[1]); callables are evaluated here, and one
        that raises is itself a divergence (e.g. a state dict the implementation cannot take). The
        comparison reports under the test's catalogue entry, or `pitfall` where it checks another."""
        component, pitfall = self._entry(pitfall)
        key = {"component": component, "pitfall": pitfall, "implementations": list(names), "test": self.test}
        a_value, a_error = _evaluate(actual)
        b_value, b_error = _evaluate(expected)
        for name, error in ((names[0], a_error), (names[1], b_error)):
            if isinstance(error, Unsupported):  # a case this implementation cannot express: n/a, with its reason
                self.not_applicable(names, f"{what + ': ' if what else ''}{name}: {error}", pitfall=pitfall)
                return None
        for error in (a_error, b_error):
            if isinstance(error, PlugMismatch):  # the plug is older than the call: not the codebase's divergence
                self.plug_mismatch(names, f"{what + ': ' if what else ''}{error}", pitfall=pitfall)
                return None
        if a_error or b_error:
            fields = {"message": f"{what + ': ' if what else ''}"
                                 f"{names[0] if a_error else names[1]} raised {_describe(a_error or b_error)}"}
        else:
            fields = tensor_difference(a_value, b_value, tolerance)
            if fields is not None and what:
                fields["message"] = f"{what}: {fields['message']}"
        if fields is None:
            self.sink("pass", None, key)
            return None
        entry = DiffEntry(component=component, pitfall=pitfall, implementations=names, example=self.example,
                          test=self.test, **fields)
        if set(names) <= self.reference_names:
            # Two references disagreeing is a finding about the references, not a failure of ours: a status of its
            # own, reported by the test (REFERENCES DIFFER, never PASSED) and held to a golden list
            # (conformance/references_differ.toml), so a disagreement gained or lost fails the run.
            self.sink(REFERENCES_DIFFER, entry, key)
            return entry
        self.sink("fail", entry, key)
        raise Divergence(entry)


    def run(self, names: tuple[str, str], operation: Callable[[], Any], what: str = "", *,
            pitfall: int | None = None) -> tuple[bool, Any]:
        """Call one side's operation outside a comparison (its output feeds rule checks): `(True, value)`,
        or `(False, None)` once an unsupported case is recorded n/a or a plug mismatch recorded; any other error is
        a divergence."""
        value, error = _evaluate(operation)
        if error is None:
            return True, value
        self.compare(names, lambda: _reraise(error), None, EXACT, what, pitfall=pitfall)
        return False, None  # only an Unsupported case or a plug mismatch gets here: compare raised for anything else


def _reraise(error: Exception):
    raise error


def _describe(error: Exception) -> str:
    return f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"


def _evaluate(value: Any) -> tuple[Any, Exception | None]:
    if not callable(value):
        return value, None
    try:
        return value(), None
    except Divergence:
        raise
    except Exception as error:  # noqa: BLE001 - reported as the divergence it is (n/a when Unsupported)
        return None, error

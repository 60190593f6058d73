"""The plug boundary: the implementation under test seen through the interface version it declares.

`Plug` wraps it for the suite. Before each interface operation runs, the call is bound to the plug's own
signature; a call it cannot take (a keyword it does not accept, an argument it lacks), an operation added
after the version it implements, and a recipe field it does not have raise `PlugMismatch`, naming the
interface change (impl/interface_versions.py). The comparator records that as `plug-mismatch`, never as a
divergence of the codebase the plug wraps: what runs inside the plug (its own calls, the codebase's errors)
is not checked here and stays the comparison it is.
"""

from __future__ import annotations

import copy
import inspect
from typing import Any

from impl import interface, interface_versions as versions

PROTOCOLS = (interface.DFlashImplementation, interface.DFlash2Operations, interface.SlotLayoutOperations,
             interface.DraftVocabOperations, interface.FamilyHeadOperations, interface.FamilyTrainingOperations)


class PlugMismatch(Exception):
    """The plug cannot take a call of the current interface: it implements an older version."""


def declared_version(implementation: Any) -> int:
    """The version a plug declares; one declaring none predates versions (1). A wrong declaration is an error."""
    declared = getattr(implementation, "interface_version", None)
    if declared is None:
        return versions.UNDECLARED
    if isinstance(declared, bool) or not isinstance(declared, int) or not 1 <= declared <= versions.CURRENT:
        raise ValueError(f"interface_version {declared!r}: this suite knows versions 1 to {versions.CURRENT}")
    return declared


def _implements(implementation: Any) -> str:
    declared = getattr(implementation, "interface_version", None)
    return (f"the plug implements interface {declared}" if declared is not None
            else f"the plug declares no interface_version (read as {versions.UNDECLARED})")


def _describe_change(version: versions.Version | None, scope: str, name: str) -> str:
    if version is None:
        return f"`{name}` is part of interface {versions.CURRENT}"
    old = versions.renamed_from(version, scope, name)
    change = f"renamed `{old}` to `{name}`" if old else f"added `{name}`"
    return f"interface {version.number} {change} ({version.summary})"


def current_parameters(operation: str) -> list[str]:
    """The operation's parameters (self excluded) as the current interface declares them."""
    declared = next(getattr(protocol, operation) for protocol in PROTOCOLS if hasattr(protocol, operation))
    return list(inspect.signature(declared).parameters)[1:]


def _positional_capacity(signature: inspect.Signature) -> int | None:
    """How many positional arguments a signature takes (None: any number)."""
    kinds = [p.kind for p in signature.parameters.values()]
    if inspect.Parameter.VAR_POSITIONAL in kinds:
        return None
    return sum(kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD) for kind in kinds)


def _binding_problem(method: Any, operation: str, args: tuple, kwargs: dict) -> str | None:
    """Why `method` cannot take this call, naming the interface change; None when it can."""
    try:
        signature = inspect.signature(method)
    except (TypeError, ValueError):  # a builtin or C callable: nothing to bind against
        return None
    try:
        signature.bind(*args, **kwargs)
        return None
    except TypeError as error:
        params = signature.parameters
        open_keywords = any(p.kind is p.VAR_KEYWORD for p in params.values())
        unknown = [] if open_keywords else [k for k in kwargs if k not in params]
        capacity = _positional_capacity(signature)
        if capacity is not None and len(args) > capacity:  # the interface passes more, positionally: name them
            unknown += current_parameters(operation)[capacity:len(args)]
        if unknown:
            return "; ".join(f"{operation}() takes no `{k}`: "
                             f"{_describe_change(versions.keyword_change(operation, k), operation, k)}" for k in unknown)
        return f"{operation}() cannot take the call ({error})"


def recipe_field(implementation: Any, name: str) -> Any:
    """`implementation.recipe.<name>`; a recipe without the field is a plug mismatch naming when it came in."""
    recipe = implementation.recipe
    if not hasattr(recipe, name):
        raise PlugMismatch(f"plug mismatch: its recipe ({type(recipe).__name__}) has no `{name}`: "
                           f"{_describe_change(versions.recipe_field_change(name), 'recipe', name)}; "
                           f"{_implements(implementation)}")
    return getattr(recipe, name)


class Plug:
    """Forwards everything to the wrapped implementation; interface operations are bound-checked first."""

    def __init__(self, implementation: Any):
        object.__setattr__(self, "_wrapped", implementation)
        object.__setattr__(self, "_version", declared_version(implementation))

    @property
    def wrapped(self) -> Any:
        return self._wrapped

    def __getattr__(self, name: str) -> Any:
        wrapped = self._wrapped
        if name not in versions.operations():
            return getattr(wrapped, name)
        method = getattr(wrapped, name, None)
        if not callable(method):
            added = versions.operation_added(name)
            if added is None or added <= self._version:
                raise AttributeError(name)  # an operation the plug's version has and the plug lacks: n/a
            return _missing(name, f"plug mismatch: no `{name}` operation: {_describe_change(versions.BY_NUMBER[added], name, name)}; "
                                  f"{_implements(wrapped)}")
        return _checked(method, name, wrapped)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._wrapped, name, value)

    def __copy__(self) -> Plug:
        return Plug(copy.copy(self._wrapped))

    def __repr__(self) -> str:
        return f"Plug({self._wrapped!r})"


def _missing(name: str, message: str):
    def operation(*args, **kwargs):
        raise PlugMismatch(message)

    operation.__name__ = name
    operation.plug_mismatch = message
    return operation


def require(implementation: Any, operation: str) -> None:
    """Raise the plug mismatch of an operation added after the plug's version that the plug lacks, before anything
    else the test would ask of it (an older plug's `build_drafter` refusing a DSpark spec must not hide it)."""
    message = getattr(getattr(implementation, operation, None), "plug_mismatch", None)
    if message is not None:
        raise PlugMismatch(message)


def _spec_problem(name: str, version: int, args: tuple, kwargs: dict) -> str | None:
    """A case newer than the plug: a drafter spec (or a drafter built from one) needing a later interface."""
    for value in (*args, *kwargs.values()):
        spec = value if hasattr(value, "block_size") and hasattr(value, "family") else getattr(value, "spec", None)
        needs = versions.spec_needs(spec) if spec is not None else None
        if needs is not None and needs[0] > version:
            return f"{name}() given {needs[1]}"
    return None


def _checked(method: Any, name: str, wrapped: Any):
    def operation(*args, **kwargs):
        problem = _binding_problem(method, name, args, kwargs) or \
            _spec_problem(name, declared_version(wrapped), args, kwargs)
        if problem is not None:
            raise PlugMismatch(f"plug mismatch: {problem}; {_implements(wrapped)}")
        return method(*args, **kwargs)

    operation.__name__ = name
    return operation

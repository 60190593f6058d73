"""Which engine reads a drafter: the installed release checked against the pinned one, then the engine's own module.

The one module that imports the engine modules (they import `served`, never this), so the package has no import circle.
"""

from __future__ import annotations

from pathlib import Path

from serving_engines.served import ENGINES, Served, TargetFacts


def check_engine(engine: str) -> str:
    """The installed engine's version; an AuditError with the fix unless it is the release the rules were read
    from (foundation/packages.py): every cited line and restated rule belongs to that release."""
    from foundation.errors import AuditError
    from foundation.packages import BY_NAME, installed_version

    if engine == "llamacpp":
        from serving_engines.llamacpp_engine import check_tree

        return check_tree()
    if engine not in BY_NAME:
        raise AuditError(f"unknown engine {engine!r}; expected one of {list(ENGINES)}")
    found, wanted = installed_version(BY_NAME[engine].distribution), BY_NAME[engine].pinned
    if found != wanted:
        state = "is not installed" if found is None else f"is {found}"
        raise AuditError(f"serving engine {engine} {state}; the serving check reads {engine}=={wanted}: "
                         f"pip install --no-deps {engine}=={wanted} (or `make setup`)")
    return found


def resolve(engine: str, path: str | Path, target: TargetFacts, trained_block_size: int | None,
            num_target_layers: int | None = None, **options) -> Served:
    """How `engine` reads the drafter directory `path`. `num_target_layers` stands in for the target's depth when
    no target is given (the drafter's own record of it). `options`: llama.cpp's command (n_max, kv_type)."""
    check_engine(engine)
    if engine == "llamacpp":
        from serving_engines import llamacpp_engine

        return llamacpp_engine.resolve(Path(path), target, trained_block_size, num_target_layers, **options)
    if engine == "vllm":
        from serving_engines import vllm_engine as module  # lazily: only the engine asked for
    elif engine == "sglang":
        from serving_engines import sglang_engine as module
    else:
        raise ValueError(f"unknown engine {engine!r}; expected one of {list(ENGINES)}")
    return module.resolve(Path(path), target, trained_block_size, num_target_layers)

"""The serving engines (vLLM 0.33.0, SGLang 0.5.23) reading a drafter directory through their own code.

`resolve(engine, path, num_target_layers, target)` -> `Served`: the values the engine will run the drafter with.
Each engine's rules are called where its module imports on a CPU machine and executed from the installed source
otherwise (`source_exec.py`); `rules.RULES` says which, per field. Beside `reference_adapters/` in the layering.
"""

from __future__ import annotations

from serving_engines.dispatch import check_engine, resolve
from serving_engines.served import ALL_ENGINES, ENGINES, Served, TargetFacts

__all__ = ["ALL_ENGINES", "ENGINES", "Served", "TargetFacts", "check_engine", "resolve"]

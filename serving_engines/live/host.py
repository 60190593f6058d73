"""The host side of a live run (`serve-check --live`): one vLLM engine process started on the request
(`engine_driver.py` is its engine side), its captured steps written to driver.json. What they say is read as a source
of rounds and held to the audit's replay by the rounds core (`dflash_audit/rounds/vllm.py`, `dflash_audit/rounds/`).

One engine process serves the target alone (the greedy reference) and then each drafter, as `serve-check` prints its
command (K = the trained block size - 1), greedy, on the audit's prompts, in the target's dtype, its max model length
what the prompts need (`context_length`): long prompts run past a drafter's sliding window.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from foundation.errors import AuditError
from serving_engines.live.engine_process import start_engine, stop_engine
from serving_engines.live.vllm_env import DRIVER, VllmEnvironment, engine_timeout_s

ENGINE_ENV = {"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_LOGGING_LEVEL": "WARNING"}


# What runs a drafter vLLM's CPU (V1) runner refuses: one that mixes sliding and full layers, or a DSpark drafter.
V2_HINT = ("what would run it: a GPU and vLLM's V2 model runner (VLLM_USE_V2_MODEL_RUNNER=1); the V2 runner "
           "needs Triton, which has no CPU build")
# The model file each family needs in the engine's vLLM (vllm-cpu 0.32.0 has DSpark's, not XPress's).
FAMILY_MODEL_FILES = {"dspark": "model_executor/models/qwen3_dspark.py",
                      "xpress": "model_executor/models/qwen3_xpress.py"}
# The `method` vLLM serves each family under (vllm/config/speculative.py: XPress is a refiner under dflash).
FAMILY_METHODS = {"dspark": "dspark"}


@dataclass
class ServedDrafter:
    """A drafter as the engine reads it (a directory) and as it was trained (spec + the audit's loaded model)."""

    name: str
    source: str  # what the user named
    served_path: str  # the directory vLLM loads
    spec: Any
    notes: list[str] = field(default_factory=list)
    plants: list[str] = field(default_factory=list)
    marks: Any = None  # its window, trained length and rotary (`tau.along_context.ContextMarks`), for τ along the context


def context_length(prompts: list[dict], max_new_tokens: int, block_size: int = 0,
                   max_positions: int | None = None) -> int:
    """An engine's context (vLLM's max_model_len, llama-server's -c) for `prompts` ({"id", "ids"}): the longest
    prompt and its new tokens, and room for one more whole block and the two tokens llama.cpp keeps free (an engine
    caps a round's drafts at what its context has left: llama.cpp's server-context.cpp `n_ctx - n_tokens - 2`, so a
    context cut at the last new token would shrink the final rounds), bounded by the target's `max_positions`."""
    needed = max((len(p["ids"]) for p in prompts), default=0) + max_new_tokens
    room = block_size + 2 if block_size else 0
    return needed + room if max_positions is None else min(needed + room, max(needed, max_positions))


def mixed_layers(spec) -> bool:
    types = list(spec.layer_types or [])
    return "sliding_attention" in types and "full_attention" in types


def needs_v2(spec) -> bool:
    """vLLM's V1 runner refuses it: mixed sliding/full layers, or DSpark (vllm/config/vllm.py)."""
    return mixed_layers(spec) or spec.family == "dspark"


def method(spec) -> str:
    return FAMILY_METHODS.get(spec.family, "dflash")


def missing_model_file(env: VllmEnvironment, spec) -> str | None:
    """Why the engine cannot serve the drafter's family at all (its model file is not in that vLLM), else None."""
    relative = FAMILY_MODEL_FILES.get(spec.family)
    if relative is None or (Path(env.package_root) / relative).is_file():
        return None
    from impl.families import TITLES

    return f"vLLM {env.version} has no {TITLES[spec.family]} model: no vllm/{relative} in {env.python}'s vLLM"


def engine_command(env: VllmEnvironment, target: Path, drafter: ServedDrafter, max_model_len: int,
                   temperature: float = 0.0, seeds: list[int] | None = None) -> str:
    config = {"method": method(drafter.spec), "model": drafter.served_path,
              "num_speculative_tokens": drafter.spec.speculative_tokens}
    how = "greedy"
    if temperature > 0:
        config["draft_sample_method"] = "probabilistic"
        how = f"temperature {temperature:g}, seeds {','.join(map(str, seeds or []))} per prompt"
    return (f"{env.python} -c 'from vllm import LLM; LLM({str(target)!r}, speculative_config="
            f"{json.dumps(config)}, dtype=\"float32\", enforce_eager=True, max_model_len={max_model_len})'  "
            f"# {' '.join(f'{k}={v}' for k, v in ENGINE_ENV.items())}; {how}, one prompt at a time")


def run_engine(env: VllmEnvironment, target: Path, prompts: list[dict], drafters: list[ServedDrafter],
               max_new_tokens: int, stop_ids: list[int], dtype: str, workdir: Path, capture: bool = True,
               plant_prompts: int | dict[str, int] = 1, max_model_len: int | None = None,
               temperature: float = 0.0, seeds: list[int] | None = None) -> dict:
    """One engine process: the target alone, then every drafter (and its planted variants), its max model length
    `max_model_len` (default: `context_length` of the prompts). Returns driver.json. `temperature` > 0: each prompt
    generated once per seed of `seeds`, the drafts sampled; no greedy reference run then (nothing to compare it to)."""
    if max_model_len is None:
        max_model_len = context_length(prompts, max_new_tokens, max((d.spec.block_size for d in drafters), default=0))
    runs = [] if temperature > 0 else [{"name": "greedy"}]
    runs += [{"name": d.name, "drafter": d.served_path, "method": method(d.spec),
              "num_speculative_tokens": d.spec.speculative_tokens,
              "plants": d.plants, "plant_prompts": plant_prompts, "capture": capture} for d in drafters]
    request = {"target": str(target), "dtype": dtype, "max_model_len": max_model_len,
               "max_new_tokens": max_new_tokens, "stop_ids": stop_ids, "out": str(workdir), "prompts": prompts,
               "runs": runs, **({"temperature": temperature, "seeds": list(seeds or [])} if temperature > 0 else {})}
    request_file = workdir / "request.json"
    request_file.write_text(json.dumps(request))
    log = workdir / "engine.log"
    # The engine's temporary files (the file store of each engine start, `vllm_dist_*`, which vLLM never removes)
    # go in the run's folder, and with it.
    scratch = workdir / "engine-tmp"
    scratch.mkdir(exist_ok=True)
    started = time.monotonic()
    extra = {"VLLM_USE_V2_MODEL_RUNNER": "1"} if env.cuda and any(needs_v2(d.spec) for d in drafters) else {}
    extra["TMPDIR"] = str(scratch)
    with log.open("w") as sink:
        # Its own session: a hung engine is stopped with every process it started, nothing left running.
        engine = start_engine([env.python, str(DRIVER), str(request_file)], sink, {**os.environ, **ENGINE_ENV, **extra})
        try:
            returncode = engine.wait(timeout=engine_timeout_s())
        except subprocess.TimeoutExpired as exc:
            stop_engine(engine, hung=True)
            raise AuditError(f"the vLLM engine ({env.python}) ran past {exc.timeout:g} s without finishing; "
                             "stopped") from None
        except BaseException:  # interrupted: the engine goes with it
            stop_engine(engine)
            raise
        stop_engine(engine)  # what the engine left behind (a worker process) goes too
    result_file = workdir / "driver.json"
    if returncode != 0 or not result_file.is_file():
        tail = [line for line in log.read_text(errors="replace").splitlines() if line.strip()][-1:] or ["no output"]
        raise AuditError(f"the vLLM engine ({env.python}) failed (exit {returncode}"
                         f"{', no driver.json' if returncode == 0 else ''}): {tail[0][:300]}")
    try:
        result = json.loads(result_file.read_text())
    except ValueError as exc:
        raise AuditError(f"the vLLM engine ({env.python}) wrote an unreadable driver.json ({exc})") from None
    result["wall_s"] = time.monotonic() - started
    return result

"""The target's hidden states through vLLM's `extract_hidden_states`, from this side: the request to
`hidden_states_driver.py` (run in vLLM's own environment, `find_vllm`), its records read back.

What comes back per prompt: the greedy continuation, the states of the requested depths (vLLM's layer ids:
dflash_audit/data_check/claims.py) as vLLM's connector writes them (`<out>/<i>.safetensors`: `hidden_states` [T, L, H],
`token_ids` [T]; `data-check` reads that folder), vLLM's final norm of the last depth, and each position's top-2
margin."""

from __future__ import annotations

import json
import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from foundation.errors import AuditError
from serving_engines.live.engine_process import start_engine, stop_engine
from serving_engines.live.host import ENGINE_ENV, context_length
from serving_engines.live.vllm_env import VllmEnvironment, engine_timeout_s

DRIVER = Path(__file__).with_name("hidden_states_driver.py")
# The line of vLLM's connector that stops it on a CPU (looked up in the installed file, cited in the run's facts).
PINNED_COPY = ("distributed/kv_transfer/kv_connector/v1/example_hidden_states_connector.py",
               'hidden_states_gpu, device="cpu", pin_memory=True')


@dataclass
class VllmRecord:
    id: str
    token_ids: torch.Tensor  # [T]
    prompt_len: int
    hidden: torch.Tensor  # [T, L, H] the requested depths, in order
    normed: torch.Tensor  # [T, H] vLLM's final norm of the last depth
    margin: torch.Tensor  # [T] float32
    file: Path


def extract_hidden_states(env: VllmEnvironment, target: Path, prompts: list[dict], depths: list[int],
                          max_new_tokens: int, stop_ids: list[int], dtype: str, out: Path,
                          tensor_parallel_size: int = 1) -> tuple[list[VllmRecord], dict]:
    """One engine process; `prompts` [{"id", "ids"}]. The connector writes the files on a GPU; on a CPU the driver
    takes the same tensor at the proposer (its docstring says why). Returns the records and driver.json."""
    out.mkdir(parents=True, exist_ok=True)
    # Its proposer drafts one token a step (vLLM's extract_hidden_states method): room for that block of one.
    request = {"target": str(target), "dtype": dtype, "max_model_len": context_length(prompts, max_new_tokens, 1),
               "prompts": prompts, "depths": depths, "max_new_tokens": max_new_tokens, "stop_ids": stop_ids, "out": str(out),
               "connector": env.cuda, "tensor_parallel_size": tensor_parallel_size}
    request_file = out / "request.json"
    request_file.write_text(json.dumps(request))
    scratch = out / "engine-tmp"
    scratch.mkdir(exist_ok=True)
    log = out / "engine.log"
    started = time.monotonic()
    with log.open("w") as sink:
        engine = start_engine([env.python, str(DRIVER), str(request_file)], sink,
                              {**os.environ, **ENGINE_ENV, "TMPDIR": str(scratch)})
        try:
            returncode = engine.wait(timeout=engine_timeout_s())
        except subprocess.TimeoutExpired as exc:
            stop_engine(engine, hung=True)
            raise AuditError(f"the vLLM engine ({env.python}) ran past {exc.timeout:g} s extracting hidden states; "
                             "stopped") from None
        except BaseException:
            stop_engine(engine)
            raise
        stop_engine(engine)
    result_file = out / "driver.json"
    if returncode != 0 or not result_file.is_file():
        tail = [line for line in log.read_text(errors="replace").splitlines() if line.strip()][-1:] or ["no output"]
        raise AuditError(f"the vLLM engine ({env.python}) failed extracting hidden states (exit {returncode}): "
                         f"{tail[0][:300]}")
    result = json.loads(result_file.read_text())
    result["wall_s"] = time.monotonic() - started
    if not env.cuda:
        result["connector_stopped_at"] = env.cite(*PINNED_COPY)
    records = []
    for entry in result["records"]:
        stored = load_file(str(out / entry["file"]))
        normed = load_file(str(out / "normed" / entry["file"]))["normed"]
        records.append(VllmRecord(entry["id"], stored["token_ids"].long(), entry["prompt_len"],
                                  stored["hidden_states"], normed, torch.tensor(entry["margin"], dtype=torch.float32),
                                  out / entry["file"]))
    return records, result

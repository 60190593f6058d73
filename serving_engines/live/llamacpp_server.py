"""One `llama-server` process for the live llama.cpp check: on a loopback port the tool picks, bounded in time, always
stopped (a context manager: `engine_process.stop_engine`, also on Ctrl-C; on Linux the kernel kills it if the audit
itself dies), its log kept while it runs. Requests are the audit's token ids, greedy,
`cache_prompt` off, one at a time (`-np 1`); with `LLAMA_TRACE=1` the server logs one line per verification step,
`accepted X/ Y draft tokens` (tools/server/server-context.cpp), which is how each served round is read
(`dflash_audit/rounds/llamacpp.py`).

A server that exits, never listens or hangs is one line naming the engine's own last message (AuditError).
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

from foundation.errors import AuditError
from serving_engines.live.engine_process import start_engine, stop_engine
from serving_engines.live.llamacpp_env import LlamacppEngine

ACCEPTED = re.compile(r"accepted\s+(\d+)/\s*(\d+) draft tokens")
START_TIMEOUT_S = 120
REQUEST_TIMEOUT_S = 300
CONTEXT = 2048  # the context when the caller names none (the live check names what its prompts need)
LOG_WAIT_S = 10


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def peak_rss_mb(pid: int) -> float | None:
    """A running process's peak resident memory (Linux's VmHWM), None where /proc does not say."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    found = re.search(r"^VmHWM:\s+(\d+) kB", status, re.MULTILINE)
    return int(found.group(1)) / 1024 if found else None


def last_message(log: Path) -> str:
    """The engine's own message for why it stopped: an abort's assertion (not the backtrace after it), else its first
    error line (the cause: "couldn't bind HTTP server socket", not the "exiting due to HTTP server error" after
    it), else its last line."""
    lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    for line in lines:
        if "GGML_ASSERT" in line:
            return line[:300]
    errors = [line for line in lines if (" E " in f" {line} " or line.lower().startswith("error"))
              and "this warning is normal" not in line]  # a drafter's context fitting logs one such, harmless
    return (errors[0] if errors else lines[-1] if lines else "no output")[:300]


class LlamaServer:
    """`with LlamaServer(engine, target_gguf, log, drafter_gguf, n_max) as server: server.complete(ids, n)`."""

    def __init__(self, engine: LlamacppEngine, target_gguf: Path, log: Path, drafter_gguf: Path | None = None,
                 n_max: int | None = None, kv_type: str | None = None, threads: int = 1, port: int | None = None,
                 start_timeout_s: float = START_TIMEOUT_S, request_timeout_s: float = REQUEST_TIMEOUT_S,
                 log_vocabulary: bool = False, context: int = CONTEXT):
        # -c is the one slot's context; the drafter's context is made with the same size (common_speculative).
        self.command = [engine.server, "-m", str(target_gguf), "-np", "1", "-c", str(context), "-t", str(threads),
                        "--host", "127.0.0.1"]
        if log_vocabulary:  # the loader's info lines, its end-of-generation set among them, are logged from -lv 4
            self.command += ["-lv", "4"]
        if drafter_gguf is not None:
            self.command += ["-md", str(drafter_gguf), "--spec-type", "draft-dflash"]
            if n_max is not None:
                self.command += ["--spec-draft-n-max", str(n_max)]
            if kv_type is not None:
                self.command += ["-ctkd", kv_type, "-ctvd", kv_type]
        self.log = log
        self.process: subprocess.Popen | None = None
        self.port = port
        self.start_timeout_s, self.request_timeout_s = start_timeout_s, request_timeout_s
        self.read_upto = 0
        self.peak_rss_mb: float | None = None  # the server's own peak resident memory, read as it is stopped

    def __enter__(self) -> LlamaServer:
        try:
            return self.start()
        except BaseException:  # a refusal, a timeout, Ctrl-C while it loads: never leave it running
            self.stop()
            raise

    def start(self) -> LlamaServer:
        self.port = self.port or free_port()
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with self.log.open("w") as sink:
            self.process = start_engine([*self.command, "--port", str(self.port)], sink,
                                        {**os.environ, "LLAMA_TRACE": "1"})
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise AuditError(f"llama-server exited ({self.process.returncode}) before listening: "
                                 f"{last_message(self.log)}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as reply:
                    # Ours, not another server on the port: it is still running once the port answers.
                    if reply.status == 200 and self.process.poll() is None:
                        return self
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                time.sleep(0.1)
        raise AuditError(f"llama-server did not listen on 127.0.0.1:{self.port} within {self.start_timeout_s:g} s: "
                         f"{last_message(self.log)}")

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self, hung: bool = False) -> None:
        """Stop it and its process group (`engine_process.stop_engine`: a hung one is killed at once)."""
        if self.process is not None:
            if self.process.poll() is None:
                self.peak_rss_mb = peak_rss_mb(self.process.pid)
            stop_engine(self.process, hung=hung)

    def new_log(self) -> str:
        text = self.log.read_text(errors="replace")
        new, self.read_upto = text[self.read_upto:], len(text)
        return new

    def complete(self, ids: list[int], max_new_tokens: int) -> dict:
        """{tokens, accepted (per verification step), drafted, timings} of one greedy request."""
        self.new_log()
        body = {"prompt": ids, "n_predict": max_new_tokens, "temperature": 0, "top_k": 1, "cache_prompt": False,
                "return_tokens": True, "seed": 0}
        request = urllib.request.Request(f"http://127.0.0.1:{self.port}/completion", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=self.request_timeout_s) as reply:
                result = json.loads(reply.read())
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError) as exc:
            time.sleep(0.5)  # an abort's message reaches the log as the process dies
            exited = self.process.poll() is not None
            state = (f"exited ({self.process.returncode})" if exited
                     else f"did not answer within {self.request_timeout_s:g} s ({exc})")
            self.stop(hung=not exited)
            raise AuditError(f"llama-server {state}: {last_message(self.log)}") from None
        timings = result.get("timings", {})
        # The server logs from its own thread: a request's trace lines may land after its reply. They are read
        # until they account for the reply's own totals (draft_n, draft_n_accepted), within a bound.
        text, deadline = self.new_log(), time.monotonic() + LOG_WAIT_S
        while True:
            steps = [(int(m.group(1)), int(m.group(2))) for m in ACCEPTED.finditer(text)]
            totals = (sum(d for _, d in steps), sum(a for a, _ in steps))
            if totals == (timings.get("draft_n", 0), timings.get("draft_n_accepted", 0)):
                break
            if time.monotonic() > deadline:
                raise AuditError(f"llama-server's trace lines account for {totals[0]} drafted / {totals[1]} accepted "
                                 f"tokens, its reply for {timings.get('draft_n')} / {timings.get('draft_n_accepted')}")
            time.sleep(0.05)
            text += self.new_log()
        return {"tokens": list(result.get("tokens") or []), "accepted": [a for a, _ in steps],
                "drafted": [d for _, d in steps], "timings": timings}


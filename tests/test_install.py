"""`pip install dflash-audit` into an environment that already holds the user's torch, transformers and references.

The wheel is built from the sources, then installed with pip into a fresh virtual environment that sees this
machine's installed packages (every entry of the suite's site-packages but dflash-audit itself, as a user's
environment holds them) and nothing else: no index, no download. pip must find every declared dependency already
there. The references go in as docs/setup.md says where `[references]` cannot resolve (speculators 0.9.0 declares
torchvision and torchaudio its DFlash model never imports): `[references-runtime]`, then speculators with --no-deps.
Then the installed tool runs from outside the repository: `--version`, a static `compare` on the test world,
`doctor --json`, the reference imports, and the conformance suite importable from the install.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SOURCES = ("pyproject.toml", "README.md", "dflash_audit", "foundation", "catalogue", "impl", "reference_adapters",
           "held", "serving_engines", "dflash_world", "drafter_files", "conformance")


def run(*argv, cwd: Path, env: dict | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    done = subprocess.run([str(a) for a in argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, (argv, done.stdout[-2000:], done.stderr[-3000:])
    return done


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("install")
    source = root / "source"  # a copy: the build writes build/ and *.egg-info beside the sources
    source.mkdir()
    for name in SOURCES:
        (shutil.copytree if (REPO / name).is_dir() else shutil.copy2)(
            REPO / name, source / name, **({"ignore": shutil.ignore_patterns("__pycache__")}
                                           if (REPO / name).is_dir() else {}))
    run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q", "-w",
        root / "dist", ".", cwd=source)
    (wheel,) = (root / "dist").glob("dflash_audit-*.whl")
    # The user's environment: every package installed here except dflash-audit (this checkout's editable install).
    existing = root / "existing"
    existing.mkdir()
    ours = ("dflash_audit", "__editable__", "__editable___dflash_audit")
    for entry in Path(sysconfig.get_paths()["purelib"]).iterdir():
        if not entry.name.startswith(ours) and entry.suffix != ".pth":
            (existing / entry.name).symlink_to(entry)
    venv = root / "venv"
    run(getattr(sys, "_base_executable", sys.executable), "-m", "venv", "--without-pip", venv, cwd=root)
    python = venv / "bin" / "python"
    site = Path(run(python, "-I", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])",
                    cwd=root).stdout.strip())
    (site / "existing-packages.pth").write_text(f"{existing}\n")
    # Nothing of this checkout on the new environment's path (the suite's PYTHONPATH names it).
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    pip = [sys.executable, "-m", "pip", "--python", python, "install", "--no-index", "--disable-pip-version-check"]
    first = run(*pip, f"{wheel}[references-runtime]", cwd=root, env=env)
    second = run(*pip, "--no-deps", "speculators==0.9.0", cwd=root, env=env)
    return {"root": root, "venv": venv, "python": python, "env": env, "pip": first.stdout + second.stdout,
            "site": site}


def test_the_wheel_installs_from_what_is_already_there(installed):
    """Every declared dependency was satisfied by the packages present: pip downloaded and installed nothing else."""
    lines = [line for line in installed["pip"].splitlines() if line.startswith("Successfully installed")]
    assert lines == ["Successfully installed dflash-audit-0.1.0"], installed["pip"][-2000:]
    assert (installed["site"] / "dflash_audit" / "templates" / "report.html.j2").is_file()
    assert (installed["site"] / "conformance" / "README.md").is_file()


def test_the_installed_tool_runs_outside_the_checkout(installed, test_world, tmp_path):
    from dflash_world.drafter import cached_full_drafter, cached_test_drafter

    env, cwd = installed["env"], tmp_path
    version = run("dflash-audit", "--version", cwd=cwd, env=env).stdout
    assert version.splitlines()[0] == "dflash_audit 0.1.0" and "torch " in version
    # The wheel's code, not this checkout's, and the references and the conformance suite importable beside it (one
    # process: each import of torch and transformers costs seconds).
    imports = ("import dflash_audit, dflash.model, speculators.models.dflash, conformance.comparator; "
               "print(dflash_audit.__file__); print('ok')")
    where, ok = run(installed["python"], "-c", imports, cwd=cwd, env=env).stdout.strip().splitlines()[-2:]
    assert where.startswith(str(installed["site"])) and ok == "ok", (where, ok)
    done = subprocess.run(["dflash-audit", "compare", "--ours", str(cached_test_drafter(test_world)), "--ref",
                           str(cached_full_drafter(test_world)), "--static-only", "--out", str(tmp_path / "report")],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 1, done.stderr[-3000:]  # the two drafters differ: divergences, a report
    data = json.loads((tmp_path / "report" / "report.json").read_text())
    assert data["findings"] and (tmp_path / "report" / "index.html").is_file()


def test_doctor_names_what_each_verb_lacks(installed, tmp_path):
    missing = tmp_path / "no-python"
    report = json.loads(run("dflash-audit", "doctor", "--json", "--vllm-python", missing, cwd=tmp_path,
                            env=installed["env"]).stdout)
    assert report["packages"]["dflash_audit"]["version"] == "0.1.0"
    assert report["engines"]["vllm-python"]["found"] is False and str(missing) in report["engines"]["vllm-python"][
        "problem"]
    assert {"needs": "vllm-python", "for": "--live (vllm)"} in report["missing"]["serve-check"]
    assert report["missing"]["trace"] == []

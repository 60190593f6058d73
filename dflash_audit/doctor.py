"""`dflash-audit doctor`: what this installation can run. The packages of foundation/packages.py with their
versions, the engines found (the llama-server build, the vLLM interpreter, SGLang), and for each verb what it needs
that is missing, with the flag that needs it. A user's own environment is read as it is: nothing is installed, built
or downloaded."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from foundation.errors import AuditError
from foundation.packages import PACKAGES, installed_version

# What a verb needs beyond the tool's own dependencies, and the flag or use that needs it. Each need is a package
# (its distribution name) or an engine (`llamacpp`, `vllm-python`).
NEEDS: dict[str, tuple[tuple[str, str], ...]] = {
    "compare": (("vllm", "--serve vllm"), ("sglang", "--serve sglang"), ("vllm-python", "--live with --serve vllm, "
                "--hidden-states vllm"), ("llamacpp", "--live with --serve llamacpp")),
    "eval": (("dflash", "--tau-method zlab-loop / zlab-benchmark"),),
    "train": (("speculators", "--recipe speculators"),),
    "convert": (("speculators", "--format speculators"), ("llamacpp", "--for llamacpp")),
    "serve-check": (("vllm", "--engine vllm"), ("sglang", "--engine sglang"), ("vllm-python", "--live (vllm)"),
                    ("llamacpp", "--live (llamacpp)")),
    "trace": (),
    "data-check": (("datasets", "a speculators output folder (load_from_disk)"),),
    "demo": (("vllm", "its serving check"), ("sglang", "its serving check")),
    "conformance": (("dflash", "`pytest --pyargs conformance`"), ("speculators", "`pytest --pyargs conformance`"),
                    ("pytest", "`pytest --pyargs conformance`"), ("hypothesis", "`pytest --pyargs conformance`")),
}


@dataclass
class Engine:
    name: str
    found: bool
    where: str
    version: str = ""
    problem: str = ""


def llamacpp_engine(bin_dir: Path | None) -> Engine:
    from serving_engines.live.llamacpp_env import BUILD, find_llamacpp

    try:
        engine = find_llamacpp(bin_dir)
    except AuditError as exc:
        return Engine("llamacpp", False, str(bin_dir or f"the pinned build b{BUILD}"), problem=str(exc))
    return Engine("llamacpp", True, engine.bin_dir, engine.version)


def vllm_engine(python: Path | None) -> Engine:
    from serving_engines.live.vllm_env import DEFAULT_PYTHON, find_vllm

    try:
        found = find_vllm(python)
    except AuditError as exc:
        return Engine("vllm-python", False, str(python or DEFAULT_PYTHON), problem=str(exc))
    return Engine("vllm-python", True, found.python, found.version)


def sglang_engine() -> Engine:
    version = installed_version("sglang")
    return Engine("sglang", version is not None, "this Python", version or "",
                  "" if version else "sglang is not installed in this Python")


def diagnose(vllm_python: Path | None = None, llamacpp_bin: Path | None = None) -> dict[str, Any]:
    """The report `doctor` prints and `--json` writes."""
    packages = {p.name: {"distribution": p.distribution, "role": p.role, "pinned": p.pinned,
                         "version": installed_version(p.distribution)} for p in PACKAGES}
    engines = {e.name: e for e in (llamacpp_engine(llamacpp_bin), vllm_engine(vllm_python), sglang_engine())}
    found = {name for name, engine in engines.items() if engine.found}
    found |= {p.distribution for p in PACKAGES if packages[p.name]["version"]}
    found |= {name for name in ("datasets", "pytest", "hypothesis") if installed_version(name)}
    verbs = {verb: [{"needs": need, "for": use} for need, use in needs if need not in found]
             for verb, needs in NEEDS.items()}
    return {"schema": "dflash-audit/doctor/1", "packages": packages,
            "engines": {name: vars(engine) for name, engine in engines.items()}, "missing": verbs}


def doctor_text(report: dict[str, Any]) -> str:
    from tabulate import tabulate

    rows = [[name, p["version"] or "not installed", p["role"] + (f", written against {p['pinned']}"
                                                                 if p["pinned"] else "")]
            for name, p in report["packages"].items()]
    lines = [tabulate(rows, headers=["package", "version", "role"], tablefmt="github"), ""]
    rows = [[name, "found" if e["found"] else "missing", e["version"] or "", e["where"]]
            for name, e in report["engines"].items()]
    lines += [tabulate(rows, headers=["engine", "state", "version", "where"], tablefmt="github"), ""]
    for verb, missing in report["missing"].items():
        if not missing:
            lines.append(f"{verb}: everything it uses is here")
        for need in missing:
            lines.append(f"{verb}: {need['for']} needs {need['needs']}, which is missing")
    return "\n".join(lines)

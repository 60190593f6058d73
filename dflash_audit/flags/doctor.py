"""`doctor`'s flags, declared once (`DoctorFlags`): its options, `--help` and docs table are generated from them."""

from __future__ import annotations

from pathlib import Path

from dflash_audit.flags import VerbFlags, flag


class DoctorFlags(VerbFlags):
    """`doctor`'s flags."""

    json_output: bool = flag(False, "--json", help="print the report as JSON instead of tables")
    vllm_python: Path | None = flag(None, help="a Python with vLLM to ask (default .venv-vllm/bin/python)")
    llamacpp_bin: Path | None = flag(None, help="a folder with your own llama-server and llama-quantize")

"""What a library's exception may add to a one-line refusal: its first line, never an exception's name."""

from __future__ import annotations

import re

INTERNAL_NAME = re.compile(r"\b[A-Z]\w*(Error|Exception)\b|Traceback")


def describe(exc: BaseException, fallback: str = "truncated or corrupt") -> str:
    lines = str(exc).strip().splitlines()
    line = lines[0][:160] if lines else ""
    return fallback if not line or INTERNAL_NAME.search(line) else line

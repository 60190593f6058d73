"""The scan over every refusal the suites produce in-process: the reason an error carried (before the CLI's
last-resort cleaning) may not contain a Python exception class name, and no refusal may be the unforeseen-fault
line ("rerun with --debug"): each is a defect to fix where the value is read. A test that provokes an
unforeseen fault on purpose says so with `@pytest.mark.unforeseen`."""

from __future__ import annotations

import contextlib
import re

# An exception class name as Python prints one (`KeyError`, `safetensors_rust.SafetensorError`), or a traceback.
CLASS_NAME = re.compile(r"\b(?:[a-z_]\w*\.)*[A-Z]\w*(?:Error|Exception)\b|Traceback")


def raw_reason(exc: BaseException) -> str:
    message = getattr(exc, "format_message", None)
    return message() if callable(message) else str(exc)


def offences(seen: list[tuple[BaseException, str]]) -> list[str]:
    found = []
    for exc, line in seen:
        if line.endswith("rerun with --debug"):
            found.append(f"an unforeseen fault: {line}")
        elif CLASS_NAME.search(raw_reason(exc)):
            found.append(f"an exception class name in the reason {raw_reason(exc)[:300]!r} (shown as {line!r})")
    return found


@contextlib.contextmanager
def recorded_refusals():
    """Every refusal the CLI gives inside the block, as [(exception, the line shown)]."""
    from dflash_audit import cli

    seen: list[tuple[BaseException, str]] = []
    real = cli.error_message

    def recording(exc):
        line = real(exc)
        seen.append((exc, line))
        return line

    cli.error_message = recording
    try:
        yield seen
    finally:
        cli.error_message = real

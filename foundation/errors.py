"""The error every layer raises for bad input; the CLI turns it into one line and exit status 2.

It lives at the bottom (foundation) so that our drafter, the adapters, the conformance suite and the CLI can
all raise it without importing upward.
"""

import codecs
import re
from typing import Any


class AuditError(Exception):
    """Bad input or usage: reported as `dflash-audit: error: <message>`, exit status 2."""


class SpecError(ValueError):
    """An inconsistent or invalid drafter description; the message names the field."""

    def __init__(self, field_name: str, message: str):
        self.field = field_name
        super().__init__(f"{field_name}: {message}")


class CheckpointError(ValueError):
    """A checkpoint that cannot be read as what it claims to be; one line, naming the culprit."""


# An exception class name as Python prints one (`TypeError:`, `safetensors_rust.SafetensorError`).
CLASS_NAME = re.compile(r"\b(?:[a-z_]\w*\.)*[A-Z]\w*(?:Error|Exception|Exit|Interrupt|Warning)\b:?")
ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]")


def plain_reason(text: str, limit: int = 200) -> str:
    """A library's message as part of a one-line refusal: one line, no terminal escapes, no class names."""
    text = CLASS_NAME.sub("", ANSI.sub("", str(text)))
    return " ".join(text.split()).strip(" :;,")[:limit]


# -- file names that are not UTF-8 (Linux allows any bytes but `/` and NUL) ----------------------------------------
def printable(text: str) -> str:
    """`text` with the undecodable bytes of a file name (Python's surrogate escapes) shown as \\xNN: what a
    terminal, a JSON report and an HTML page show of such a name."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace") \
            if all(not 0xD800 <= ord(c) <= 0xDC7F for c in text) else text.encode("utf-8", "backslashreplace").decode()


def escaped(value: Any) -> Any:
    """`value` (a report's data) with every string `printable`."""
    if isinstance(value, str):
        return printable(value)
    if isinstance(value, dict):
        return {escaped(k): escaped(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [escaped(v) for v in value]
    return value


def _escape_names(exc: UnicodeError) -> tuple[str, int]:
    if not isinstance(exc, UnicodeEncodeError):
        raise exc
    return printable(exc.object[exc.start:exc.end]), exc.end


NAME_ESCAPES = "dflash-audit-names"  # an error handler for text streams: such names printed as \\xNN
codecs.register_error(NAME_ESCAPES, _escape_names)

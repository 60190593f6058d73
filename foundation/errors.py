"""The error every layer raises for bad input; the CLI turns it into one line and exit status 2.

It lives at the bottom (foundation) so that our drafter, the adapters, the conformance suite and the CLI can
all raise it without importing upward.
"""

import re


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

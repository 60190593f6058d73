"""The error every layer raises for bad input; the CLI turns it into one line and exit status 2.

It lives at the bottom (foundation) so that our drafter, the adapters, the conformance suite and the CLI can
all raise it without importing upward.
"""


class AuditError(Exception):
    """Bad input or usage: reported as `dflash-audit: error: <message>`, exit status 2."""


class CheckpointError(ValueError):
    """A checkpoint that cannot be read as what it claims to be; one line, naming the culprit."""

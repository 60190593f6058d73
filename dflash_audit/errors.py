"""The one exception the CLI turns into a one-line error and exit status 2."""


class AuditError(Exception):
    """Bad input or usage: reported as `dflash-audit: error: <message>`, exit status 2."""

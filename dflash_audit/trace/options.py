"""What `dflash-audit trace` hands the recorder inside the traced command: its options, validated by the verb as
`TraceFlags` and carried in the environment as one pydantic model (its JSON), validated again where the recorder
reads it; and the marks by which the recorder tells the verb how far the command got, files in a folder of the
verb's own (never in --out, named apart in the environment so that even options that cannot be read can be said):
`installed.<pid>` (the bootstrap installed the recorder in that process),
`install-failed.<pid>` (it could not, and why), `stepped.<pid>` (that process began its first training step, or
its first evaluation round), `exited.<pid>` (it reached Python's normal exit, where the recorder writes what it
holds). Only the standard library and pydantic at import: the bootstrap reads this before torch."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from dflash_audit.trace.recording import ENV_OPTIONS, ENV_OUT

ENV_MARKS = "DFLASH_AUDIT_TRACE_MARKS"


class Mark:
    """The marks' names."""

    INSTALLED = "installed"
    INSTALL_FAILED = "install-failed"
    STEPPED = "stepped"
    EXITED = "exited"


class RecorderOptions(BaseModel):
    """The recorder's options in the traced command (`Recorder.from_options`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    out: Path  # the recording folder, absolute
    steps: int = Field(1, ge=0)
    target: str | None = None
    drafter_class: str | None = Field(None, pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
    evaluation: bool = False
    parity: int = Field(0, ge=0)

    def environment(self, env: dict, marks: Path | None = None) -> dict:
        """`env` with these options set for the traced command, and the folder for its marks."""
        env = dict(env)
        env[ENV_OUT] = str(self.out)
        env[ENV_OPTIONS] = self.model_dump_json()
        env.pop(ENV_MARKS, None)
        if marks is not None:
            env[ENV_MARKS] = str(marks)
        return env

    @classmethod
    def from_environment(cls) -> RecorderOptions:
        """The options the verb set; ValueError (one line) when they are not what this version writes."""
        text = os.environ.get(ENV_OPTIONS)
        try:
            if text is None:  # only the folder named (a bench or a hand-set environment): the defaults
                return cls(out=Path(os.environ[ENV_OUT]).resolve())
            return cls.model_validate_json(text)
        except ValidationError as exc:
            problem = exc.errors()[0]
            where = ".".join(str(part) for part in problem["loc"]) or "the options"
            raise ValueError(f"{ENV_OPTIONS}: {where}: {problem['msg']}") from None


def mark(what: str, text: str = "") -> None:
    """Leave the mark `what` for this process (a few bytes; nothing when the verb asked for no marks, or its folder
    is gone)."""
    folder = os.environ.get(ENV_MARKS)
    if not folder:
        return
    with contextlib.suppress(OSError):
        (Path(folder) / f"{what}.{os.getpid()}").write_text(text)


def marked(folder: Path, what: str) -> dict[int, str]:
    """The processes that left the mark `what`, with its text."""
    found = {}
    for path in Path(folder).glob(f"{what}.*"):
        pid = path.name[len(what) + 1:]
        if pid.isdigit():
            with contextlib.suppress(OSError):
                found[int(pid)] = path.read_text(errors="replace")
    return found

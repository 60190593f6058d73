"""What `dflash-audit trace` hands the recorder inside the traced command: its options, validated by the verb as
`TraceFlags` and carried in the environment as one pydantic model (its JSON), validated again where the recorder
reads it (`RecorderOptions.from_environment`); with them, the folder for the recorder's marks (marks.py)."""

from __future__ import annotations

import os
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from dflash_audit.trace.record.marks import ENV_MARKS
from dflash_audit.trace.record.recording import ENV_OPTIONS, ENV_OUT


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

"""Prompts files (JSON lines) and how a prompt becomes token ids.

A line is `{"id": ..., "prompt": "..."}` or z-lab's `{"turns": [...]}` (first turn used;
the id defaults to the line number). Tokenization renders through the one chat template setting
(`foundation.chat_template.ChatTemplate`), so every drafter and every reference loop sees the same ids.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import torch
from pydantic import AfterValidator, ConfigDict, Field, model_validator

from foundation.chat_template import ChatTemplate
from foundation.errors import AuditError
from foundation.inputs import read_utf8
from foundation.jsonl import check_text, json_lines
from impl.settings import Declared
from impl.spec import SpecError


def _non_empty_text(value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError(f"must be a non-empty string, got {repr(value)[:60]}")
    return value


class PromptRecord(Declared):
    """One line of a prompts file, as pydantic reads it: `{"id", "prompt"}` or z-lab's `{"turns": [...]}` (its first
    turn the prompt); any other key (a reference answer, a category) is kept unread. A refusal names the key."""

    SUBJECT = "the record"
    model_config = ConfigDict(frozen=True, extra="allow", strict=True)

    id: Any = None  # any JSON value, as its text; the line number when absent
    prompt: Annotated[Any, AfterValidator(_non_empty_text)] | None = None
    turns: list[Any] | None = Field(None, min_length=1)

    @model_validator(mode="after")
    def _a_prompt(self) -> PromptRecord:
        if self.prompt is None and self.turns is None:
            raise ValueError("needs a 'prompt' or a 'turns' field")
        if self.prompt is None:
            try:
                _non_empty_text(self.turns[0])
            except ValueError as exc:
                raise SpecError("turns", f"the first turn {exc}") from None
        return self

    @property
    def text(self) -> str:
        return self.prompt if self.prompt is not None else self.turns[0]


def _prompt_from_record(record, where: str, line_no: int) -> dict[str, str]:
    if not isinstance(record, dict):
        raise AuditError(f"{where}: expected a JSON object, found {type(record).__name__}")
    try:
        read = PromptRecord(**{str(key): value for key, value in record.items()})
    except SpecError as exc:  # Declared.refusal's one line, naming the key
        raise AuditError(f"{where}: {exc}") from None
    check_text(read.text, f"{where}: the prompt", AuditError)
    identity = read.id if read.id is not None else line_no
    return {"id": check_text(str(identity), f"{where}: the id", AuditError), "prompt": read.text}


def load_prompts(path: str | Path) -> list[dict[str, str]]:
    """`[{"id", "prompt"}]`, one per non-empty line; a bad line is a one-line error naming file:line."""
    path = Path(path)
    if path.suffix.lower() in (".parquet", ".pq"):
        raise AuditError(f"--prompts {path}: a parquet file; a plain prompts file is JSON lines {{\"id\", \"prompt\"}}: "
                         "give a benchmark's parquet as NAME:PATH (e.g. gsm8k:PATH)")
    text = read_utf8(path, "prompts file")  # a FIFO or non-UTF-8 file is a one-line error, never a hang
    prompts = [_prompt_from_record(record, where, line_no)
               for line_no, where, record in json_lines(text, path, AuditError)]
    if not prompts:
        raise AuditError(f"{path}: no prompts in the file")
    ids = [p["id"] for p in prompts]
    duplicate = next((i for i in ids if ids.count(i) > 1), None)
    if duplicate is not None:
        raise AuditError(f"{path}: prompt id {duplicate!r} appears more than once")
    return prompts


def tokenize_prompt(tokenizer, prompt: dict[str, str] | str, chat: ChatTemplate | None = None) -> torch.Tensor:
    """Token ids [1, T] of one prompt (a `{"id", "prompt"}` record or its text), rendered by `chat` (`--chat-template`,
    `--chat-template-kwargs`; default auto: the tokenizer's own template when it has one)."""
    text = prompt["prompt"] if isinstance(prompt, dict) else prompt
    return (chat or ChatTemplate("auto")).ids(tokenizer, [{"role": "user", "content": text}])


def tokenize_prompts(tokenizer, prompts: list[dict[str, str]],
                     chat: ChatTemplate | None = None) -> list[tuple[str, torch.Tensor]]:
    """`[(id, ids [1, T])]` for every prompt."""
    return [(p["id"], tokenize_prompt(tokenizer, p, chat)) for p in prompts]


def fit_prompts(prompts: list[tuple[str, torch.Tensor]], max_new_tokens: int, max_positions: int,
                truncate: bool = False, source: str = "prompts",
                truncatable: bool = True) -> tuple[list[tuple[str, torch.Tensor]], list[str]]:
    """Prompts whose length + `max_new_tokens` fits the target's `max_position_embeddings`, and notes
    on those cut to fit: `truncate` keeps a too-long prompt's last tokens, otherwise it is an error (which offers
    `--truncate` where the verb takes it: `truncatable`)."""
    room = max_positions - max_new_tokens
    if room < 1:
        raise AuditError(f"--max-new-tokens {max_new_tokens} leaves no room for a prompt: the target has "
                         f"max_position_embeddings {max_positions}")
    fitted, notes = [], []
    for prompt_id, ids in prompts:
        length = ids.shape[1]
        if length > room:
            if not truncate:
                raise AuditError(f"{source}: prompt {prompt_id!r} has {length} tokens + --max-new-tokens "
                                 f"{max_new_tokens} = {length + max_new_tokens}, beyond the target's "
                                 f"max_position_embeddings {max_positions}"
                                 + (f" (--truncate keeps its last {room} tokens)" if truncatable else ""))
            ids = ids[:, -room:]
            notes.append(f"prompt {prompt_id!r} truncated to its last {room} of {length} tokens "
                         f"(max_position_embeddings {max_positions} - --max-new-tokens {max_new_tokens})")
        fitted.append((prompt_id, ids))
    return fitted, notes

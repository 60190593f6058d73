"""JSON lines: the one way this project cuts a file into records.

A record ends at "\n" and nowhere else. `str.splitlines` also cuts at U+2028, U+2029 and
U+0085, which JSON allows raw inside a string, so it would turn one valid record into two
invalid halves. Every JSON-lines reader (training data, prompts) goes through `json_lines`;
tests/test_restatements.py fails on a `splitlines()` in a module that parses JSON lines.
"""

from __future__ import annotations

import json
from collections.abc import Iterator


def check_text(text: str, where: str, error: type[Exception]) -> str:
    """`text` if it is text: JSON's `\\ud800` escapes can smuggle a lone surrogate in, which no tokenizer takes."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise error(f"{where}: holds a lone surrogate (\\u{ord(text[exc.start]):04x}), not text") from None
    return text


def split_json_lines(text: str) -> list[str]:
    """The lines of a JSON-lines text, cut at "\\n" only (a trailing "\\r" is JSON whitespace)."""
    return text.split("\n")


def json_lines(text: str, source, error: type[Exception]) -> Iterator[tuple[int, str, object]]:
    """(line number, `source:line`, parsed value) of every non-blank line of `text`; a line that
    is not JSON raises `error` naming its file and line."""
    for number, line in enumerate(split_json_lines(text), start=1):
        if not line.strip():
            continue
        where = f"{source}:{number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise error(f"{where}: invalid JSON ({exc.msg})") from exc
        except RecursionError:  # `[[[[...` thousands deep: no record nests like that
            raise error(f"{where}: JSON nested too deeply to read") from None
        yield number, where, record

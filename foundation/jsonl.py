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


MAX_JSON_DEPTH = 200  # no config, prompt or record nests past a few levels; past this, walking it may exhaust the stack


class JsonTooDeep(ValueError):
    """JSON nested past MAX_JSON_DEPTH (or past what Python's parser can hold)."""


def parse_json(text: str) -> object:
    """`json.loads(text)`, held to MAX_JSON_DEPTH: the one parse of a JSON input. A value nested deeper (`[[[[...`
    thousands deep) is refused here, where the file is known, not wherever a later walk over it runs out of stack.
    JsonTooDeep past it; json.JSONDecodeError for text that is not JSON."""
    try:
        value = json.loads(text)
    except RecursionError:
        raise JsonTooDeep("JSON nested too deeply to read") from None
    if nests_deeper(value, MAX_JSON_DEPTH):
        raise JsonTooDeep(f"JSON nested deeper than {MAX_JSON_DEPTH} levels") from None
    return value


def nests_deeper(value: object, limit: int) -> bool:
    """Whether `value`'s lists and objects nest deeper than `limit` (walked without recursion)."""
    stack = [(value, 0)]
    while stack:
        node, depth = stack.pop()
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else None
        if children is None:
            continue
        if depth >= limit:
            return True
        stack.extend((child, depth + 1) for child in children)
    return False


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
            record = parse_json(line)
        except json.JSONDecodeError as exc:
            raise error(f"{where}: invalid JSON ({exc.msg})") from exc
        except JsonTooDeep as exc:  # `[[[[...` thousands deep: no record nests like that
            raise error(f"{where}: {exc}") from None
        yield number, where, record

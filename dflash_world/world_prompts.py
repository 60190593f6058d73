"""Prompts for the demo world: plain code prefixes in the style of the standard library."""

from __future__ import annotations

import json
import os
import random
from collections.abc import Iterable, Sequence
from pathlib import Path

# Written for this project (not copied from the library): beginnings of functions and
# classes of the kind the target saw in training. Each ends on a non-space character:
# the byte-level BPE glues a newline to the next line's indentation and a space to the
# next word, so a prompt ending in whitespace would end on a token split the target
# never saw in training.
BUILTIN_PROMPTS = [
    {"id": "split-words", "prompt": 'def split_words(text):\n    """Return the list of words in *text*, split on whitespace."""'},
    {"id": "read-config", "prompt": 'import os\n\n\ndef read_config(path):\n    """Read a key=value file and return a dict."""\n    result = {}\n    with open(path) as f:'},
    {"id": "stack-class", "prompt": 'class Stack:\n    """A last-in, first-out stack."""\n\n    def __init__(self):\n        self._items = []\n\n    def push(self, item):'},
    {"id": "repr-method", "prompt": "class Point:\n\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n\n    def __repr__(self):"},
    {"id": "type-check", "prompt": 'def check_name(name):\n    if not isinstance(name, str):\n        raise TypeError("name must be a string, not %s" % type(name).__name__)'},
    {"id": "find-files", "prompt": 'def find_files(directory, suffix):\n    """Yield the paths of the files in *directory* ending with *suffix*."""\n    for name in os.listdir(directory):'},
    {"id": "dict-counter", "prompt": "def count_items(iterable):\n    counts = {}\n    for item in iterable:"},
    {"id": "error-class", "prompt": 'class ParseError(Exception):\n    """Raised when the input cannot be parsed."""\n\n    def __init__(self, msg, lineno):'},
    {"id": "property", "prompt": "class Buffer:\n\n    def __init__(self, size):\n        self._size = size\n        self._data = bytearray(size)\n\n    @property\n    def size(self):"},
    {"id": "try-import", "prompt": "try:\n    import zlib\nexcept ImportError:\n    zlib = None\n\n__all__ = ["},
    {"id": "main-guard", "prompt": 'def main(args=None):\n    import argparse\n    parser = argparse.ArgumentParser(description="Show file sizes.")\n    parser.add_argument('},
    {"id": "join-lines", "prompt": 'def join_lines(lines, sep="\\n"):\n    """Join *lines* with *sep*, dropping empty ones."""\n    return sep.join('},
]


def heldout_prompts(texts: Sequence[str], n: int, seed: int = 0, *, avoid: Sequence[str] = (),
                    min_chars: int = 200, max_chars: int = 400) -> list[dict]:
    """Up to `n` prompts cut from held-out files: whole lines, `min_chars`..`max_chars`
    long, without the last newline (see BUILTIN_PROMPTS for why).

    Deterministic for a given seed; at most one prompt per file, from files picked at
    random. A prompt found verbatim in any of `avoid` (the training texts: boilerplate
    recurs across files) is dropped."""
    rng = random.Random(seed)
    prompts = []
    for index in rng.sample(range(len(texts)), len(texts)):
        prompt = _cut_prefix(texts[index], rng, min_chars, max_chars)
        if prompt is not None and not any(prompt in text for text in avoid):
            prompts.append({"id": f"heldout-{len(prompts)}", "prompt": prompt})
            if len(prompts) == n:
                break
    return prompts


def _cut_prefix(text: str, rng: random.Random, min_chars: int, max_chars: int) -> str | None:
    """A run of whole lines of min_chars..max_chars that starts at a random line."""
    lines = text.splitlines(keepends=True)
    starts = list(range(len(lines)))
    rng.shuffle(starts)
    for start in starts[:20]:
        # Begin at real code, not inside a blank stretch.
        if not lines[start].strip():
            continue
        prompt = ""
        for line in lines[start:]:
            if len(prompt) + len(line) > max_chars:
                break
            prompt += line
        prompt = prompt.rstrip()
        if len(prompt) >= min_chars:
            return prompt
    return None


def write_prompts_jsonl(path: str | os.PathLike, prompts: Iterable[dict]) -> None:
    """Write one JSON object a line, atomically (foundation.atomic: temp file, then rename)."""
    from foundation.atomic import atomic_write_bytes

    text = "".join(json.dumps(prompt, ensure_ascii=False) + "\n" for prompt in prompts)
    atomic_write_bytes(Path(path), lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))

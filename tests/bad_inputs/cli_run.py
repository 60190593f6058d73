"""Running the real CLI in-process on a hostile input, and what every outcome must look like."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from dflash_audit.cli import main
from tests.refusal_scan import CLASS_NAME


def run(argv: list, capsys) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def assert_refused(code: int, err: str, *names: str) -> str:
    """Exit 2, one `dflash-audit: error:` line naming each of `names`, no exception class name, not unforeseen."""
    lines = err.strip("\n").splitlines()
    assert code == 2, err
    assert len(lines) == 1, err
    line = lines[0]
    assert line.startswith("dflash-audit: error: "), err
    assert not CLASS_NAME.search(line), line
    assert "rerun with --debug" not in line, f"an unforeseen fault: {line}"
    for name in names:
        assert str(name) in line, (name, line)
    return line


def tree_digest(root: Path) -> dict[str, str]:
    """Every entry under `root` (files by content, links by target, special files by kind); never opens a FIFO."""
    digest = {}
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            path = Path(folder) / name
            rel = str(path.relative_to(root))
            if path.is_symlink():
                digest[rel] = "link:" + os.readlink(path)
            elif path.is_file():
                digest[rel] = hashlib.sha256(path.read_bytes()).hexdigest()
            else:
                digest[rel] = "dir" if path.is_dir() else "special"
    return digest

"""Runs llama.cpp's own `convert_hf_to_gguf.py` (argv after the tree's path are its own arguments), unchanged but
for one case: a tokenizer whose BPE pre-tokenizer hash the tree does not know (`get_vocab_base_pre` raises) and whose
pre-tokenizer is plain byte-level (`{"type": "ByteLevel", "use_regex": true}`, GPT-2's split and nothing else) is
named "gpt-2", the pre-tokenizer llama.cpp runs for exactly that split. Any other unknown pre-tokenizer still fails
as the tree fails. The tree is never edited; a line on stderr says when the case was taken.

Run as `python llamacpp_converter_shim.py TREE ARGS...` with the converter's environment (torch, transformers,
sentencepiece; the tree's gguf-py first on the path). Standalone: it imports nothing of the audit.
"""

from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path

SETTLED = "llamacpp-converter-shim: unknown pre-tokenizer hash settled as 'gpt-2' (plain byte-level pre-tokenizer)"


def plain_byte_level(tokenizer_dir: Path) -> bool:
    try:
        pre = json.loads((tokenizer_dir / "tokenizer.json").read_text()).get("pre_tokenizer")
    except (OSError, ValueError):
        return False
    return (isinstance(pre, dict) and pre.get("type") == "ByteLevel" and pre.get("use_regex", True) is True
            and not pre.get("add_prefix_space", False))


def main() -> None:
    tree = Path(sys.argv[1]).resolve()
    sys.path[:0] = [str(tree / "gguf-py"), str(tree)]
    from conversion.base import TextModel

    known = TextModel.get_vocab_base_pre

    def get_vocab_base_pre(self, tokenizer) -> str:
        try:
            return known(self, tokenizer)
        except NotImplementedError:
            if not plain_byte_level(Path(self.dir_model)):
                raise
            print(SETTLED, file=sys.stderr)
            return "gpt-2"

    TextModel.get_vocab_base_pre = get_vocab_base_pre
    sys.argv = [str(tree / "convert_hf_to_gguf.py"), *sys.argv[2:]]
    runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    main()

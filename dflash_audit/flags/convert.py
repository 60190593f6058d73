"""`convert`'s flags, declared once (`ConvertFlags`): its options, `--help` and docs table are generated from them."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import model_validator

from dflash_audit.flags import VerbFlags, flag
from serving_engines.live.llamacpp_convert import QUANT_TYPES
from serving_engines.served import ALL_ENGINES


class ConvertFlags(VerbFlags):
    """`convert`'s flags."""

    source: Path = flag(..., "--from", help="Drafter to read (ours *.pt, z-lab or speculators directory).")
    destination: Path = flag(..., "--to", help="Where to write (a *.pt file for ours, a directory otherwise).")
    fmt: Literal["ours", "zlab", "speculators"] | None = flag(None, "--format", help="Destination format.")
    engine: Literal[ALL_ENGINES] | None = flag(None, "--for", help="Serving engine: write what it serves as trained "
                                                                    "(llamacpp: DIR/drafter-<quant>.gguf).")
    quant: Literal[QUANT_TYPES] | None = flag(None, help="--for llamacpp: the GGUF's type (default f32).")
    llamacpp_bin: Path | None = flag(None, help="--for llamacpp: a folder with your own llama-server and "
                                                "llama-quantize.")
    target: Path | None = flag(None, help="Target (verifier) directory; required for speculators.")
    allow_lossy: bool = flag(False, help="Convert even if the drafter would change.")
    entry: str | None = flag(None, help="Entry of a training dict holding the state dict.")
    key_map: Path | None = flag(None, help="Parameter names: 'PATTERN => REPLACEMENT' per line.")
    spec: list[str] = flag([], help="KEY=VALUE spec/recipe field of the source (repeatable).")
    force: bool = flag(False, help="Replace an existing drafter of the same format at --to.")

    @model_validator(mode="after")
    def one_destination(self) -> ConvertFlags:
        if (self.fmt is None) == (self.engine is None):
            raise ValueError("give exactly one of --format (ours, zlab, speculators) and --for (vllm, sglang, "
                             "llamacpp)")
        if self.quant is not None and self.engine != "llamacpp":
            raise ValueError("--quant applies to --for llamacpp only")
        return self

    @property
    def load_options(self):
        from dflash_audit.formats import LoadOptions

        return LoadOptions(self.entry, self.key_map, list(self.spec), flag_prefix="")

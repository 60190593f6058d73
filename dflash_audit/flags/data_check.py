"""`data-check`'s flags, declared once (`DataCheckFlags`): its options, `--help` and docs table are generated from
them."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import BeforeValidator, model_validator

from dflash_audit.flags import DEVICE_HELP, DTYPE_NAMES, ChatKwargs, Device, VerbFlags, flag


def parse_layer_ids(text: object) -> object:
    """Comma-separated ids as integers; a ValueError in words (the flag's declaration names it)."""
    if not isinstance(text, str):
        return text
    try:
        ids = [int(part) for part in text.replace(" ", "").split(",") if part != ""]
    except ValueError:
        raise ValueError(f"{text!r}: expected comma-separated integers, e.g. 2,7,12") from None
    if not ids:
        raise ValueError("give at least one layer id")
    if len(set(ids)) != len(ids):
        raise ValueError(f"{text}: an id given twice")
    return ids


LayerIds = Annotated[list[int], BeforeValidator(parse_layer_ids)]


class DataCheckFlags(VerbFlags):
    """`data-check`'s flags."""

    dataset: Path = flag(..., "DIR", argument=True,
                         help="the dataset: a folder of vLLM / speculators *.safetensors records (or speculators' "
                              "output folder holding hidden_states/), or of SpecForge *.ckpt / *.ckpt.gz records; or "
                              "one record file")
    target: Path = flag(..., help="the target's Hugging Face folder: its states are recomputed on each record's "
                                  "token ids")
    layer_ids: LayerIds | None = flag(None, cli=str | None,
                                      help="the layer ids the dataset claims, in its writer's convention (vLLM's for "
                                           "vLLM and speculators files: 0 the embeddings, i the output after decoder "
                                           "layer i-1, N the last layer before the final norm; z-lab's for "
                                           "SpecForge), comma-separated")
    drafter: Path | None = flag(None, help="the drafter that trains on the dataset (any format compare reads): the "
                                           "layers its trainer reads are the claim")
    records: int = flag(16, gt=0, le=1_000_000, help="records checked by value, spread evenly over the dataset (one "
                                                     "in memory at a time)")
    device: Device = flag("auto", help=DEVICE_HELP)
    dtype: Literal[DTYPE_NAMES] = flag("float32", help="the target's dtype for the recomputation (auto: its "
                                                       "config's); float32 names states stored in any precision")
    chat_template: str = flag("auto", help="the template whose assistant turns loss_mask is held to: auto (the "
                                           "target tokenizer's), none, or a Jinja FILE")
    chat_template_kwargs: ChatKwargs = flag({}, cli=str | None, help="JSON kwargs for the chat template")
    out: Path | None = flag(None, help="report folder: report.json and index.html (default reports/data-check)")
    json_path: Path | None = flag(None, "--json", help="also write report.json here")
    force: bool = flag(False, help="replace report files the tool did not write")

    @model_validator(mode="after")
    def one_claim(self) -> DataCheckFlags:
        if self.layer_ids is not None and self.drafter is not None:
            raise ValueError("--layer-ids and --drafter both say what the dataset holds; give one")
        return self

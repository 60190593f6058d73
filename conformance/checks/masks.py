"""Training mask (#9), inference mask (#10), and the training/inference layouts against each other."""

from __future__ import annotations

import torch

from conformance.comparator import Comparator
from conformance.strategies import InferenceMaskCase, MaskCase
from conformance.tolerances import EXACT


def training_mask(cmp: Comparator, a, b, case: MaskCase) -> None:
    args = (case.document_ids, case.anchors, case.block_size, case.sliding_window, case.causal_block)
    cmp.compare((a.name, b.name), lambda: a.training_mask(*args), lambda: b.training_mask(*args),
                EXACT, what="[A*B, T + A*B] anchor-block mask")


def inference_mask(cmp: Comparator, a, b, case: InferenceMaskCase) -> None:
    args = (case.context_len, case.block_len, case.sliding_window, case.causal)
    cmp.compare((a.name, b.name), lambda: a.inference_mask(*args),
                lambda: b.inference_mask(*args), EXACT, what="[block, context + block] decoding mask")


def training_block_as_inference(trainer, context_len: int, block_size: int, window: int | None,
                                causal: bool) -> torch.Tensor:
    """The training mask of one anchor at `context_len` (one document), cut to the inference layout
    `[block, context | block]`: what a block sees in training, laid out as at inference."""
    total = context_len + block_size
    mask = trainer.training_mask(torch.zeros(1, total, dtype=torch.long), torch.tensor([context_len]), block_size,
                                 window, causal)
    return torch.cat([mask[:, :context_len], mask[:, total:]], dim=1)


def training_vs_inference(cmp: Comparator, trainer, decoder, case: tuple[int, int, int | None]) -> None:
    """A block must see at inference what it saw in training (the layouts of the two references)."""
    context_len, block_size, window = case
    causal = window is not None
    layout = f"sliding window {window}" if window else "full attention"
    cmp.compare((trainer.name, decoder.name),
                training_block_as_inference(trainer, context_len, block_size, window, causal),
                decoder.inference_mask(context_len, block_size, window, causal), EXACT,
                what=f"block after {context_len} context tokens, B={block_size}, {layout}: training vs inference")


def block_direction_training_vs_inference(cmp: Comparator, trainer, decoder, case: tuple[int, int, int | None]) -> None:
    """Bidirectional sliding blocks: what a block sees *of itself* in training and at inference. The
    context part is #10's (the references bound it differently whatever the block's direction)."""
    context_len, block_size, window = case
    cmp.compare((trainer.name, decoder.name),
                training_block_as_inference(trainer, context_len, block_size, window, False)[:, context_len:],
                decoder.inference_mask(context_len, block_size, window, False)[:, context_len:], EXACT,
                what=f"block slots a block sees of itself, B={block_size}, bidirectional sliding window {window}: "
                     "training vs inference")

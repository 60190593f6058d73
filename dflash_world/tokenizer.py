"""A byte-level BPE tokenizer trained on the corpus, wrapped as a Hugging Face tokenizer."""

from __future__ import annotations

from collections.abc import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from .presets import DEFAULT_VOCAB_SIZE

EOS_TOKEN = "<|endoftext|>"
# DFlash drafters fill the not-yet-drafted positions of a block with this token.
MASK_TOKEN = "<|mask|>"
SPECIAL_TOKENS = (EOS_TOKEN, MASK_TOKEN)  # ids 0 and 1


def train_tokenizer(
    texts: Iterable[str], *, vocab_size: int = DEFAULT_VOCAB_SIZE
) -> PreTrainedTokenizerFast:
    """Byte-level BPE: every byte sequence encodes, and decoding gives it back exactly.

    No chat template and no BOS: the target is a plain code model whose prompts are
    code prefixes.
    """
    bpe = Tokenizer(models.BPE())
    # No prefix space: source text must round-trip byte for byte.
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        additional_special_tokens=[MASK_TOKEN],
        # The default clean-up would rewrite " ." and " ," in decoded code.
        clean_up_tokenization_spaces=False,
        model_max_length=1 << 30,
    )


def mask_token_id(tokenizer: PreTrainedTokenizerFast) -> int:
    return tokenizer.convert_tokens_to_ids(MASK_TOKEN)

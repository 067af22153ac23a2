"""A tiny tokenizer for the tests that need a real Hugging Face one, trained rather than
downloaded."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def byte_level_bpe(corpus: Sequence[str], *, vocab_size: int, special_tokens: Sequence[str]) -> Any:
    """A GPT-2 style tokenizer (`tokenizers.Tokenizer`: byte-level BPE, no prefix space) of
    `vocab_size` tokens with `special_tokens`, trained on `corpus`."""
    # Imported here: the modules that use this also run where tokenizers is missing.
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus, trainer)
    return tokenizer

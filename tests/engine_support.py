"""Helpers shared by the engine tests (test_engine*.py): prompts and the exactness check."""

from __future__ import annotations

import torch

from prefixkv.engine.facade import RequestResult
from prefixkv.models.decoder import LlamaModel

#: Largest logit difference an engine result may have from a full recompute.
TOLERANCE = 1e-4


def random_prompt(length: int, seed: int) -> list[int]:
    """`length` byte-tokenizer ids (0..255), the same for the same seed."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (length,), generator=generator).tolist()


def assert_exact(model: LlamaModel, result: RequestResult, max_new_tokens: int) -> None:
    """`result` is `model`'s greedy continuation computed in full, logits within `TOLERANCE`."""
    assert result.output_token_ids == model.generate_greedy_full(
        result.prompt_token_ids, max_new_tokens
    )
    assert result.max_logit_diff is not None and result.max_logit_diff < TOLERANCE

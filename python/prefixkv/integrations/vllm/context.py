"""The `CacheContext` of a vLLM model: what must match for two instances to share block keys.

vLLM's own block hashes name only tokens, salt, LoRA and multimodal inputs: the model is implicit
(one pool per engine). prefixkv's keys travel further (KV events, routers, remote tiers), so the
fingerprint names the model: its Hugging Face config *content* (two checkpoints under one name
differ there), the weights revision, the compute dtype, the KV cache dtype and the block size,
plus the position encoding read from the config so that length-dependent RoPE scaling is refused
(`CacheContext.reuse_is_safe`).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from prefixkv.context import AttentionMask, CacheContext, PositionEncoding


def _config_digest(hf_config: Any) -> str:
    # to_json_string(use_diff=False) is transformers' own canonical dump of every field the
    # model reads (defaults included), sorted; the digest of that is the config's content.
    try:
        text = hf_config.to_json_string(use_diff=False)
    except (AttributeError, TypeError):
        text = json.dumps(hf_config.to_dict(), sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def _rope(hf_config: Any) -> PositionEncoding:
    # transformers 5 keeps RoPE settings in `rope_parameters`; older configs in `rope_scaling`
    # beside `rope_theta`. "default" is plain RoPE.
    params = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None)
    theta = getattr(hf_config, "rope_theta", None)
    scaling: str | None = None
    scaling_params: tuple[tuple[str, float], ...] = ()
    if isinstance(params, dict):
        theta = params.get("rope_theta", theta)
        kind = params.get("rope_type", params.get("type"))
        if kind not in (None, "default"):
            scaling = str(kind)
            scaling_params = tuple(
                sorted(
                    (str(k), float(v))
                    for k, v in params.items()
                    if isinstance(v, (int, float)) and not isinstance(v, bool)
                )
            )
    return PositionEncoding(
        rope_theta=float(theta) if isinstance(theta, (int, float)) else 10000.0,
        rope_scaling=scaling,
        rope_scaling_params=scaling_params,
    )


def vllm_cache_context(
    vllm_config: Any, block_size: int, sliding_window: int | None = None
) -> CacheContext:
    """The context the block keys of `vllm_config`'s model are made under."""
    model_config = vllm_config.model_config
    cache_config = vllm_config.cache_config
    dtype = str(model_config.dtype).removeprefix("torch.")
    kv_dtype = str(cache_config.cache_dtype)
    mask = (
        AttentionMask()
        if sliding_window is None
        else AttentionMask(kind="sliding_window", sliding_window=sliding_window)
    )
    return CacheContext(
        model_id=str(model_config.model),
        weights_digest=str(model_config.revision or ""),
        tokenizer_id=str(model_config.tokenizer or ""),
        position_encoding=_rope(model_config.hf_config),
        attention_mask=mask,
        kv_dtype=dtype if kv_dtype == "auto" else kv_dtype,
        kv_quantization="none" if kv_dtype == "auto" else kv_dtype,
        block_size=block_size,
        extra={
            "engine": "vllm",
            "hf_config_sha256": _config_digest(model_config.hf_config),
            "dtype": dtype,
            "kv_cache_dtype": kv_dtype,
        },
    )

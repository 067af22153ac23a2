"""What makes a vLLM block's KV differ, bound into prefixkv block keys.

Two engines may exchange a block only when the KV one computed is the KV the other would
compute. In vLLM that depends on:

* the model: the content of its weight files and of its config (a fine-tune, a new revision
  or an ``hf_overrides`` entry changes the KV), not the path it was loaded from;
* the model dtype, the KV cache dtype and the quantization;
* the tensor-parallel rank and size (each rank holds its own heads) and the pipeline size;
* the block geometry (block size, layers, KV heads, head sizes);
* how the bytes of a block are read: the platform (cpu, cuda, ...), the attention backend vLLM
  resolves for the model (CPU_ATTN, FLASH_ATTN, ...) and the vLLM release series. A block is
  stored as its bytes, and backends read them differently (CPU_ATTN reads each head's slice
  of a block as its K rows then its V rows; another backend may interleave them per token),
  so a value must only meet engines that read it the same way;
* per request: the cache salt and the LoRA adapter (its name and the content of its files).

The engine-wide part is a `CacheContext` whose fingerprint roots every key, the per-request
part goes in the key extras (salt, adapter), and the tokens chain the keys: prefixkv's core
computes them (SHA-256, stable across processes and machines). vLLM's own block hashes are
not used: their seed is per process unless PYTHONHASHSEED is fixed, and they bind neither the
weights nor the rank.

A block is stored as ``[layers, kv_heads, block_size, head_size + head_size_v]``: vLLM's
per-layer view ``[B, H, N, C]`` of one scheduler block (kernel blocks, when the backend splits
one, concatenated in order), stacked over layers. The view hides the physical
`KVCacheLayout` (strides), so engines whose layouts differ still share values; what ``C``
holds is the backend's, hence the backend in the key.

Multimodal requests and prompt embeddings are not keyed (their KV depends on inputs the token
ids do not name): the connector neither probes nor saves them.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from prefixkv.cache import PrefixCache
from prefixkv.context import CacheContext
from prefixkv.errors import InvalidInputError
from prefixkv.tiers import BlockRecord

__all__ = [
    "KEY_VERSION",
    "BlockGeometry",
    "EngineIdentity",
    "RequestKeys",
    "adapter_identity",
    "model_files_digest",
]

#: Bumped when what a key binds changes: values under an older scheme are then never read.
KEY_VERSION = "vllm-connector-1"

#: The dtypes prefixkv's value format encodes (`prefixkv.tiers.format`); fp8 KV is refused.
_VALUE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

#: Files whose bytes are the model's weights or shape its KV; hashed in name order.
_MODEL_FILE_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
_MODEL_CONFIG_FILES = ("config.json", "params.json")


@dataclass(frozen=True)
class BlockGeometry:
    """The shape of one block's KV for one tensor-parallel rank."""

    num_layers: int
    num_kv_heads: int
    block_size: int
    head_size: int
    head_size_v: int
    dtype: torch.dtype

    @property
    def value_shape(self) -> tuple[int, int, int, int]:
        """``[layers, kv_heads, block_size, head_size + head_size_v]``."""
        return (
            self.num_layers,
            self.num_kv_heads,
            self.block_size,
            self.head_size + self.head_size_v,
        )

    @property
    def value_bytes(self) -> int:
        size = torch.empty((), dtype=self.dtype).element_size()
        for dim in self.value_shape:
            size *= dim
        return size

    @classmethod
    def from_kv_cache_config(cls, kv_cache_config: Any) -> BlockGeometry:
        """From vLLM's `KVCacheConfig`: one group of full-attention layers, or refused."""
        groups = kv_cache_config.kv_cache_groups
        if len(groups) != 1:
            raise InvalidInputError(
                f"PrefixKVConnector supports one KV cache group, this model has {len(groups)} "
                "(hybrid or sliding-window layers)"
            )
        spec = groups[0].kv_cache_spec
        kind = type(spec).__name__
        if kind != "FullAttentionSpec":
            raise InvalidInputError(
                f"PrefixKVConnector supports full attention only, the KV cache spec is {kind}"
            )
        if spec.dtype not in _VALUE_DTYPES:
            raise InvalidInputError(
                f"PrefixKVConnector stores float32, float16 or bfloat16 KV; kv_cache_dtype gives "
                f"{spec.dtype} (the value format has no code for it)"
            )
        head_size_v = getattr(spec, "head_size_v", None) or spec.head_size
        return cls(
            num_layers=len(groups[0].layer_names),
            num_kv_heads=int(spec.num_kv_heads),
            block_size=int(spec.block_size),
            head_size=int(spec.head_size),
            head_size_v=int(head_size_v),
            dtype=spec.dtype,
        )


@dataclass(frozen=True)
class EngineIdentity:
    """The engine-wide half of a key; `context(rank)` is the rank's `CacheContext`."""

    model_digest: str
    config_digest: str
    model_dtype: str
    kv_cache_dtype: str
    quantization: str
    tensor_parallel_size: int
    pipeline_parallel_size: int
    #: ``platform/backend/vllm series``, e.g. ``cpu/CPU_ATTN/0.32``.
    kv_reader: str
    geometry: BlockGeometry

    @classmethod
    def from_vllm_config(
        cls,
        vllm_config: Any,
        geometry: BlockGeometry,
        *,
        model_fingerprint: str | None = None,
    ) -> EngineIdentity:
        model_config = vllm_config.model_config
        parallel = vllm_config.parallel_config
        if parallel.pipeline_parallel_size != 1:
            raise InvalidInputError(
                "PrefixKVConnector does not support pipeline_parallel_size > 1 (each stage "
                "holds other layers; a block value holds them all)"
            )
        if model_fingerprint is not None:
            digest = f"given:{model_fingerprint}"
        else:
            digest = model_files_digest(str(model_config.model))
        return cls(
            model_digest=digest,
            config_digest=_config_digest(model_config.hf_config),
            model_dtype=str(model_config.dtype),
            kv_cache_dtype=str(vllm_config.cache_config.cache_dtype),
            quantization=str(model_config.quantization),
            tensor_parallel_size=int(parallel.tensor_parallel_size),
            pipeline_parallel_size=int(parallel.pipeline_parallel_size),
            kv_reader=kv_reader(vllm_config, geometry),
            geometry=geometry,
        )

    def context(self, tp_rank: int) -> CacheContext:
        if not 0 <= tp_rank < self.tensor_parallel_size:
            raise InvalidInputError(
                f"tp_rank {tp_rank} outside tensor_parallel_size {self.tensor_parallel_size}"
            )
        g = self.geometry
        return CacheContext(
            model_id="vllm",
            weights_digest=self.model_digest,
            kv_dtype=str(g.dtype).removeprefix("torch."),
            kv_quantization=self.kv_cache_dtype,
            block_size=g.block_size,
            extra={
                "key_version": KEY_VERSION,
                "config_digest": self.config_digest,
                "model_dtype": self.model_dtype,
                "quantization": self.quantization,
                "tp_rank": tp_rank,
                "tp_size": self.tensor_parallel_size,
                "pp_size": self.pipeline_parallel_size,
                "kv_reader": self.kv_reader,
                "value_layout": "BHNC-view",
                "num_layers": g.num_layers,
                "num_kv_heads": g.num_kv_heads,
                "head_size": g.head_size,
                "head_size_v": g.head_size_v,
            },
        )


class RequestKeys:
    """Block keys and records of requests under one rank's context."""

    def __init__(self, identity: EngineIdentity, tp_rank: int) -> None:
        self.identity = identity
        self.tp_rank = tp_rank
        self.context = identity.context(tp_rank)
        self.fingerprint = self.context.fingerprint()
        self.block_size = identity.geometry.block_size
        # The core computes the key chain; one block is all the pool this needs.
        self._keyer = PrefixCache(1, context=self.context)

    def records(
        self,
        tokens: Sequence[int],
        num_blocks: int,
        *,
        salt: str | None = None,
        adapter: str | None = None,
    ) -> list[BlockRecord]:
        """The records of the first `num_blocks` full blocks of `tokens`."""
        bs = self.block_size
        tokens = list(tokens[: num_blocks * bs])
        keys = self._keyer.block_keys(tokens, salt=salt, adapter=adapter)
        return [
            BlockRecord(key, keys[j - 1] if j else None, tuple(tokens[j * bs : (j + 1) * bs]))
            for j, key in enumerate(keys[:num_blocks])
        ]


def kv_reader(vllm_config: Any, geometry: BlockGeometry) -> str:
    """``platform/attention backend/vLLM series`` as vLLM resolves them for this model: the
    scheduler and every worker compute it alike, from the config."""
    import vllm
    from vllm.config import set_current_vllm_config
    from vllm.platforms import current_platform
    from vllm.v1.attention.selector import get_attn_backend

    try:
        with set_current_vllm_config(vllm_config):
            backend = get_attn_backend(
                geometry.head_size,
                vllm_config.model_config.dtype,
                str(vllm_config.cache_config.cache_dtype),
            ).get_name()
    except Exception as exc:  # vLLM's selector raises many kinds; the reason is in the text
        raise InvalidInputError(
            f"PrefixKVConnector could not resolve the attention backend (which decides how a "
            f"block's bytes are read): {type(exc).__name__}: {exc}"
        ) from None
    series = ".".join(str(vllm.__version__).split(".")[:2])
    return f"{current_platform.device_type}/{backend}/{series}"


def _config_digest(hf_config: Any) -> str:
    """SHA-256 of the model config as vLLM holds it (overrides applied), without the fields
    that name where it was read from."""
    data = hf_config.to_dict() if hasattr(hf_config, "to_dict") else dict(vars(hf_config))
    for field in ("_name_or_path", "name_or_path", "transformers_version", "_commit_hash"):
        data.pop(field, None)
    text = json.dumps(data, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()


@functools.lru_cache(maxsize=8)
def model_files_digest(model: str) -> str:
    """SHA-256 over the names and bytes of a local model directory's config and weight files.

    Reads every weight byte once per process (about a second per GB); pass
    ``model_fingerprint`` to skip it. A model that is not a local directory (a hub id) must
    be given a fingerprint: its name alone does not say which weights it is."""
    root = Path(model)
    if not root.is_dir():
        raise InvalidInputError(
            f"model {model!r} is not a local directory: set kv_connector_extra_config"
            "['model_fingerprint'] to its weights revision"
        )
    names = sorted(
        p.name
        for p in root.iterdir()
        if p.is_file() and (p.suffix in _MODEL_FILE_SUFFIXES or p.name in _MODEL_CONFIG_FILES)
    )
    if not any(Path(name).suffix in _MODEL_FILE_SUFFIXES for name in names):
        raise InvalidInputError(f"model directory {model!r} holds no weight files")
    digest = hashlib.sha256()
    for name in names:
        digest.update(name.encode() + b"\0")
        digest.update(_file_sha256(root / name))
    return f"sha256:{digest.hexdigest()}"


def _file_sha256(path: Path) -> bytes:
    with open(path, "rb") as handle:
        return hashlib.file_digest(handle, "sha256").digest()


@functools.lru_cache(maxsize=64)
def _adapter_files_digest(path: str) -> str:
    root = Path(path)
    if not root.is_dir():
        return f"path:{os.path.normpath(path)}"
    digest = hashlib.sha256()
    for file in sorted(p for p in root.iterdir() if p.is_file()):
        digest.update(file.name.encode() + b"\0")
        digest.update(_file_sha256(file))
    return digest.hexdigest()[:32]


def adapter_identity(lora_request: Any) -> str | None:
    """A request's LoRA as a key extra, ``name@<digest of its files>``; None without one."""
    if lora_request is None:
        return None
    name = str(getattr(lora_request, "lora_name", ""))
    path = str(getattr(lora_request, "lora_path", "") or "")
    return f"{name}@{_adapter_files_digest(path)}"

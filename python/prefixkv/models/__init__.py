"""The reference decoder and what defines it (torch): the layer that computes KV.

- `config` (`ModelConfig`): a model's shape and position-encoding settings, and the
  `CacheContext` they imply; read from and written to Hugging Face ``config.json``.
- `rope`: RoPE bases, frequencies and rotation for every scaling `RopeScaling` names.
- `gemma` (`GemmaSettings`): what Gemma 2 / Gemma 3 text compute beyond Llama (norms, caps,
  scaling, local RoPE base), the hooks the layers and decoder call where it is set.
- `batch`: what one paged forward pass is asked to compute, packed for the attention calls.
- `decoder` (`LlamaModel`): the Llama-style decoder on paged KV: prefill, decode, full recompute.
- `lora`: LoRA adapters, the active one, and what names it in a cache key.
- `checkpoint`: local Hugging Face checkpoint directories (weights, config, stop tokens).
- `gguf`: llama.cpp's GGUF files as a model, a tokenizer and a chat template.

Imports the layers below (`prefixkv.kv.pages`, `prefixkv.text.tokenizers`, the block manager), never the engine.
Import the module you need (``from prefixkv.models.decoder import LlamaModel``); the package
itself imports nothing, so reading a config does not build a model.
"""

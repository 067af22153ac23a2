"""Adapters that put prefixkv inside other inference engines.

Each engine has its own subpackage (`prefixkv.integrations.vllm`), imported only when asked for:
nothing here imports an engine, and no extra installs one (users bring their own build).
"""
